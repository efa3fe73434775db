"""Triton kernels for the model executor (attention over the paged KV cache)."""
