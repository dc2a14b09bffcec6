"""decode op family."""
