"""`--quantization gguf` and `gguf-q8`: a GGUF model's projections kept in the file's own
Q4_1 / Q8_0 blocks and multiplied by CPU kernels, instead of the fp32 copies the converter
writes: the weight and its products (blocks), read from the file and cached (loader)."""
