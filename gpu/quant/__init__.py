"""A GGUF model's weights used where they lie in the memory-mapped file: the block types and
their kernels (gguf_types), the weight a projection or embedding takes (gguf_weight), and
which --quantization mode multiplies how (loader)."""
