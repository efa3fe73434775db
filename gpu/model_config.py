"""The model's shape, read from an HF config.json: what the Llama-family forward needs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.model_files import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    qkv_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    context_length: int  # max positions a request may use (<= max_position_embeddings)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, model_dir: Path, context_length: int | None = None) -> ModelConfig:
        try:
            cfg = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from None
        archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch} in {model_dir}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = cfg["hidden_size"]
            num_q_heads = cfg["num_attention_heads"]
            max_pos = cfg["max_position_embeddings"]
            # Mistral/Qwen2 sliding windows only matter beyond the window: cap the context there
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            model_max = min(max_pos, window) if window else max_pos
            if context_length is not None and context_length > model_max:
                raise ModelLoadError(f"--context-length {context_length} exceeds the model's {model_max} positions")
            config = cls(
                model_dir=model_dir,
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_q_heads=num_q_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_q_heads,
                head_dim=cfg.get("head_dim") or hidden // num_q_heads,
                rms_norm_eps=cfg["rms_norm_eps"],
                rope=_rope_config(cfg),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=max_pos,
                context_length=context_length or model_max,
                eos_token_ids=_eos_ids(cfg, model_dir),
                bos_token_id=cfg.get("bos_token_id"),
            )
        except KeyError as e:
            raise ModelLoadError(f"{model_dir / 'config.json'} lacks {e.args[0]}") from None
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{model_dir}: mlp_bias is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{model_dir}: hidden_act {cfg['hidden_act']} is not supported (silu only)")
        if config.num_q_heads % config.num_kv_heads:
            raise ModelLoadError(
                f"{model_dir}: num_attention_heads {config.num_q_heads} is not a "
                f"multiple of num_key_value_heads {config.num_kv_heads}"
            )
        return config


def _rope_config(cfg: dict) -> RopeConfig:
    # transformers >= 5 writes rope_parameters (theta included); older configs rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    rope = RopeConfig(theta=float(theta), type=kind, factor=float(params["factor"]))
    if kind == "llama3":
        rope = RopeConfig(
            theta=float(theta),
            type=kind,
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    return rope


def _eos_ids(cfg: dict, model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [cfg.get("eos_token_id")]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            sources.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        except ValueError:
            pass
    for src in sources:
        for i in src if isinstance(src, list) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """float32 [head_dim / 2], computed exactly as transformers' rope init functions do, so
    cos/sin match bit for bit."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq
