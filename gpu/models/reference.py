"""transformers' own model of a model file: the reference computation ringserve's outputs are
held to (the parity tests, perf/forward_bench.py, perf/offline_bench.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gpu.models.model_files import default_model_path, resolve_model_dir


def reference_model(model_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' model of a GGUF file (the default model's when None), dequantized by
    transformers with ringserve's config.json of it (which sets what transformers' GGUF loader
    misses), or of an HF directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = default_model_path() if model_path is None else Path(model_path)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    config = AutoConfig.from_pretrained(resolve_model_dir(path))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype).eval()
