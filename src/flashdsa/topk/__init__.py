"""topk op family."""
