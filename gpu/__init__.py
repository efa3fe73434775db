"""The model executor: weights, Llama-family forward on a paged KV cache, sampling."""
