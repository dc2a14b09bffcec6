"""Sparse MLA attention: each query attends only its selected KV rows (forward, backward, V4 ``sparse_attn``)."""
