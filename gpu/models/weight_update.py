"""Weights updated in place (SGLang's /update_weights_from_disk) and read back by name
(/get_weights_by_name): a new checkpoint is loaded whole and checked against the served model
(the same kind of file, architecture, config and every weight's shape) before any served
weight changes, so a checkpoint that does not match leaves the served one untouched."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gpu.models.model_config import ModelConfig
from gpu.models.model_files import ModelLoadError, resolve_model_dir
from gpu.models.weights import Weight
from gpu.quant.gguf_weight import GGUFWeight

if TYPE_CHECKING:
    from gpu.models.llama import LlamaForCausalLM

Loader = Callable[[Path, ModelConfig], tuple[dict[str, Weight], str]]  # ModelRunner._weights: weights, rope style

LOAD_FORMATS = ("auto", "safetensors", "gguf")  # SGLang's load_format values served here
# config fields a checkpoint may differ in: where it is, and what the server chose for it
_CONFIG_FREE = ("model_dir", "gguf_path", "context_length")


class WeightUpdateError(Exception):
    """Why a checkpoint cannot replace the served weights; `param` names the request's field."""

    def __init__(self, message: str, param: str = "model_path") -> None:
        super().__init__(message)
        self.message, self.param = message, param


def load_matching(model: LlamaForCausalLM, load: Loader, model_path: str, load_format: str | None) -> dict[str, Weight]:
    """The weights at `model_path`, loaded by `load` as the served `model`'s were (the same
    dtype and quantization), by its names; WeightUpdateError when they cannot take their place."""
    served_gguf = model.cfg.gguf_path is not None
    path = Path(model_path)
    is_gguf = path.suffix == ".gguf"
    fmt = load_format or "auto"
    if fmt not in LOAD_FORMATS:
        raise WeightUpdateError(f"load_format {fmt!r} is not served: one of {', '.join(LOAD_FORMATS)}", "load_format")
    if fmt != "auto" and (fmt == "gguf") != is_gguf:
        raise WeightUpdateError(f"load_format {fmt!r} does not match model_path {model_path!r}", "load_format")
    if is_gguf != served_gguf:
        kind = "a .gguf file" if served_gguf else "a Hugging Face safetensors directory"
        raise WeightUpdateError(f"the served model is {kind}: model_path must be one too")
    try:
        cfg = ModelConfig.from_dir(resolve_model_dir(path), model.cfg.context_length)
    except ModelLoadError as e:
        raise WeightUpdateError(str(e)) from None
    _check_config(model.cfg, cfg)
    try:
        new, rope_style = load(path, cfg)
    except ModelLoadError as e:
        raise WeightUpdateError(str(e)) from None
    served = model.named_weights()
    if rope_style != model.ops.rope_style:
        raise WeightUpdateError(f"{model_path}: its q/k rows hold the rotary pairs otherwise ({rope_style})")
    if set(new) != set(served):
        extra = sorted(set(new) ^ set(served))[0]
        raise WeightUpdateError(f"{model_path}: weight {extra} is in one of the checkpoints only")
    for name, w in new.items():
        shape, want = _shape(w), _shape(served[name])
        if shape != want:
            raise WeightUpdateError(f"{model_path}: weight {name} has shape {shape}, the served one {want}")
    return new


def _check_config(served: ModelConfig, new: ModelConfig) -> None:
    for f in dataclasses.fields(ModelConfig):
        if f.name in _CONFIG_FREE:
            continue
        a, b = getattr(served, f.name), getattr(new, f.name)
        if a != b:
            raise WeightUpdateError(f"model_path: its config's {f.name} is {b!r}, the served model's {a!r}")


def _shape(w: Weight) -> tuple[int, ...]:
    return tuple(w.shape)


class TooManyValues(Exception):
    """The rows asked hold more values than may be returned; `max_rows` would do."""

    def __init__(self, values: int, max_rows: int) -> None:
        super().__init__(values, max_rows)
        self.values, self.max_rows = values, max_rows


def hf_weight_rows(model: LlamaForCausalLM, name: str, truncate_size: int, max_values: int) -> torch.Tensor:
    """The served weight an HF checkpoint calls `name` (a fused one's rows of it), its first
    `truncate_size` rows, float32 on the CPU; Gemma's norms as the checkpoint holds them (w, not
    the 1 + w served). A Llama-architecture GGUF's q/k rows come as its file holds them
    (llama.cpp's converter permuted each head's rows). KeyError for a name the model has not;
    TooManyValues, before any is read, for more than `max_values` values."""
    cfg = model.cfg
    D, Hq, Hkv, I = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads, cfg.intermediate_size
    weight, start, rows = _locate(model, name, D * Hq, D * Hkv, I)
    if rows is None:
        rows = weight.shape[0]
    n = min(truncate_size, rows)
    width = weight.shape[1] if len(weight.shape) > 1 else 1
    if n * width > max_values:
        raise TooManyValues(n * width, max_values // width)
    if isinstance(weight, GGUFWeight):
        out = weight.rows(torch.arange(start, start + n))
    else:
        out = weight[start : start + n].detach().to("cpu", torch.float32)
    if cfg.gemma_norms and name.endswith("norm.weight"):
        out = out - 1.0
    return out.contiguous()


def _locate(model: LlamaForCausalLM, name: str, q: int, kv: int, inter: int) -> tuple[Weight, int, int | None]:
    """(the served weight holding `name`, its first row there, its rows; None: all)."""
    top = {"model.embed_tokens.weight": model.embed, "lm_head.weight": model.lm_head, "model.norm.weight": model.norm}
    if name in top:
        return top[name], 0, None
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        raise KeyError(name)
    i, rest = int(parts[2]), ".".join(parts[3:])
    if i >= model.cfg.num_layers:
        raise KeyError(name)
    gemma = model.cfg.gemma_norms
    table: dict[str, tuple[Weight | None, int, int | None]] = {
        "input_layernorm.weight": (model.input_norm[i], 0, None),
        "post_attention_layernorm.weight": (model.attn_out_norm[i] if gemma else model.post_norm[i], 0, None),
        "self_attn.q_norm.weight": (model.q_norm[i], 0, None),
        "self_attn.k_norm.weight": (model.k_norm[i], 0, None),
        "self_attn.qkv_proj.weight": (model.qkv[i], 0, None),
        "self_attn.q_proj.weight": (model.qkv[i], 0, q),
        "self_attn.k_proj.weight": (model.qkv[i], q, kv),
        "self_attn.v_proj.weight": (model.qkv[i], q + kv, kv),
        "self_attn.q_proj.bias": (model.qkv_bias[i], 0, q),
        "self_attn.k_proj.bias": (model.qkv_bias[i], q, kv),
        "self_attn.v_proj.bias": (model.qkv_bias[i], q + kv, kv),
        "self_attn.o_proj.weight": (model.o[i], 0, None),
        "mlp.gate_up_proj.weight": (model.gate_up[i], 0, None),
        "mlp.gate_proj.weight": (model.gate_up[i], 0, inter),
        "mlp.up_proj.weight": (model.gate_up[i], inter, inter),
        "mlp.down_proj.weight": (model.down[i], 0, None),
    }
    if gemma:
        table["pre_feedforward_layernorm.weight"] = (model.post_norm[i], 0, None)
        table["post_feedforward_layernorm.weight"] = (model.mlp_out_norm[i], 0, None)
    weight, start, rows = table.get(rest, (None, 0, None))
    if weight is None:
        raise KeyError(name)
    return weight, start, rows
