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


def perturb_norms_and_biases(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, its norms' weights moved off one and its biases off zero, in place: at their
    initial values a kernel that skipped them would still match."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_tiny_adapter(base: Path, path: Path, rank: int, seed: int, targets: list[str] = LORA_TARGETS) -> Path:
    """A PEFT LoRA adapter of the model at `base` (lora_alpha 2 * rank), with random non-zero A
    and B (PEFT starts B at zero, which would make every delta nothing), saved to `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft.save_pretrained(path)
    return path


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens (EOS or not) after `prompt` of the model at `base` with the PEFT adapter
    at `adapter` merged into it (None: the base alone)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    out = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(prompt) :]
