"""The model executor, entered through model_runner.ModelRunner (null_model: the same without a
model): models (config, files, weights, the Llama-family forward), attention backends and kernels,
quantized weights (quant), the paged KV cache with its bookkeeping (kvcache), sampling."""
