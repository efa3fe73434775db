"""Tiny random-weight checkpoints made by transformers' own classes, with the default model's
tokenizer copied beside them, so that a server loads them as it loads a real model (a HF
directory) and its prompts tokenize as the default model's do."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from gpu.models.model_files import resolve_model_dir

TINY_SHAPE = dict(
    vocab_size=49152,  # the default model's tokenizer, copied beside the weights
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def save_tiny(path: Path, seed: int, family: str = "llama", **changes) -> Path:
    """A `family` ("llama" or "qwen2") model of TINY_SHAPE (with `changes`), seeded, saved to `path`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**{**TINY_SHAPE, **changes})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resolve_model_dir(None) / name, path / name)
    return path
