"""The paged KV cache: its tensors, the free list of its pages, the radix tree of cached
prefixes that shares them, and the request table whose page table maps rows to them."""
