"""What each `--quantization` value of a GGUF model runs: its weights used in place from the
file (gpu/models/weights.py load_gguf_weights), multiplied by the block kernels with the
activations named here."""

# --quantization value -> how the block kernels take the activations (gpu/quant/gguf_weight.py)
ACTIVATIONS = {"gguf": "f32", "gguf-q8": "q8"}
# what --quantization auto runs a GGUF model in where the kernels build (gpu/model_runner.py
# resolve_quantization): the fastest mode within the quality bound (perf/results/quality.md)
AUTO_QUANTIZATION = "gguf-q8"
