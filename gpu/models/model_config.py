"""The model's shape, read from an HF config.json: what the decoder forward (gpu/models/llama.py)
needs. Besides the Llama family (Llama, Mistral, Qwen2, SmolLM) it reads the variations of
that decoder the forward implements: Qwen3 and Gemma 3's per-head q/k norms, Phi-3's fused
projections, Gemma 2/3's (1 + w) norms around attention and MLP, GELU-tanh MLP, scaled
embeddings, soft-capped attention and final logits, per-layer sliding windows and local rope,
SmolLM3's layers without rope, yarn rope scaling."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gpu.models.model_files import GGUF_POINTER, ModelLoadError

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "SmolLM3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# architectures whose config names each layer's attention (layer_types): their sliding layers
# get a window in the attention itself; the others' one window for all layers caps the context
PER_LAYER_WINDOWS = (*GEMMA, "SmolLM3ForCausalLM")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # yarn: cos and sin are scaled by it


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
    # the variations of the Llama decoder; the defaults are Llama's
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (Gemma)
    qk_norm: bool = False  # RMSNorm of each q and k head before rope (Qwen3, Gemma 3)
    gemma_norms: bool = False  # norms scale by (1 + w), and norm the attention and MLP outputs too
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    query_pre_attn_scalar: float | None = None  # attention scale its ** -0.5 (Gemma), else head_dim ** -0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    sliding_windows: tuple[int | None, ...] = ()  # per layer, None: full attention; (): all full
    rope_layers: tuple[bool, ...] = ()  # per layer, False: no rope (SmolLM3); (): rope everywhere
    local_rope: RopeConfig | None = None  # the sliding layers' rope (Gemma 3), None: the same as the others
    local_rope_layers: tuple[bool, ...] = ()  # per layer, True: local_rope's (Gemma 3's sliding layers)
    gguf_path: Path | None = None  # a GGUF model's file, its weights read in place (model_dir's gguf.json)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def plain_attention(self) -> bool:
        """Causal attention over all keys with no soft-cap: what every attention backend does."""
        return self.attn_logit_softcapping is None and not any(w is not None for w in self.sliding_windows)

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
            num_layers = cfg["num_hidden_layers"]
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            windows: tuple[int | None, ...] = ()
            sliding: tuple[bool, ...] = ()
            if arch in PER_LAYER_WINDOWS:
                sliding = tuple(t == "sliding_attention" for t in _layer_types(arch, cfg, num_layers))
                windows = tuple(window if s else None for s in sliding)
                window = None
            # Mistral/Qwen2/Phi-3 sliding windows only matter beyond the window: cap the context there
            model_max = min(max_pos, window) if window else max_pos
            if context_length is not None and context_length > model_max:
                raise ModelLoadError(f"--context-length {context_length} exceeds the model's {model_max} positions")
            # a window no shorter than the context is full attention (any backend runs it)
            windows = tuple(None if w is None or w >= (context_length or model_max) else w for w in windows)
            config = cls(
                model_dir=model_dir,
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=num_layers,
                num_q_heads=num_q_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_q_heads,
                head_dim=cfg.get("head_dim") or hidden // num_q_heads,
                rms_norm_eps=cfg["rms_norm_eps"],
                rope=_rope_config(cfg, "full_attention" if arch == "Gemma3ForCausalLM" else None),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=max_pos,
                context_length=context_length or model_max,
                eos_token_ids=_eos_ids(cfg, model_dir),
                bos_token_id=cfg.get("bos_token_id"),
                hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
                qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
                gemma_norms=arch in GEMMA,
                embed_scale=hidden**0.5 if arch in GEMMA else None,
                query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if arch in GEMMA else None,
                attn_logit_softcapping=cfg.get("attn_logit_softcapping") if arch in GEMMA else None,
                final_logit_softcapping=cfg.get("final_logit_softcapping") if arch in GEMMA else None,
                sliding_windows=windows,
                rope_layers=_rope_layers(cfg, num_layers) if arch == "SmolLM3ForCausalLM" else (),
                local_rope=_rope_config(cfg, "sliding_attention") if arch == "Gemma3ForCausalLM" else None,
                local_rope_layers=sliding if arch == "Gemma3ForCausalLM" else (),
                gguf_path=_gguf_path(model_dir),
            )
        except KeyError as e:
            raise ModelLoadError(f"{model_dir / 'config.json'} lacks {e.args[0]}") from None
        if cfg.get("mlp_bias"):
            raise ModelLoadError(f"{model_dir}: mlp_bias is not supported")
        want_act = "gelu_pytorch_tanh" if arch in GEMMA else "silu"
        if config.hidden_act != want_act:
            raise ModelLoadError(f"{model_dir}: hidden_act {config.hidden_act} is not supported ({want_act} only)")
        if cfg.get("use_bidirectional_attention"):
            raise ModelLoadError(f"{model_dir}: use_bidirectional_attention is not supported (causal only)")
        for name, per_layer in (("layer_types", config.sliding_windows), ("no_rope_layers", config.rope_layers)):
            if per_layer and len(per_layer) != config.num_layers:
                raise ModelLoadError(f"{model_dir}: {name} has {len(per_layer)} entries for {config.num_layers} layers")
        if config.num_q_heads % config.num_kv_heads:
            raise ModelLoadError(
                f"{model_dir}: num_attention_heads {config.num_q_heads} is not a "
                f"multiple of num_key_value_heads {config.num_kv_heads}"
            )
        return config


def _gguf_path(model_dir: Path) -> Path | None:
    pointer = model_dir / GGUF_POINTER
    if not pointer.is_file():
        return None
    try:
        return Path(json.loads(pointer.read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot read {pointer}: {type(e).__name__}: {e}") from None


def _layer_types(arch: str, cfg: dict, num_layers: int) -> list[str]:
    """Each layer's attention, full_attention or sliding_attention: the config's layer_types,
    or for configs written before it existed the pattern transformers derives."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if arch == "Gemma2ForCausalLM":  # alternate, the first sliding
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if arch == "Gemma3ForCausalLM":  # every sliding_window_pattern-th layer full
        pattern = cfg.get("sliding_window_pattern") or 6
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if arch == "SmolLM3ForCausalLM" and cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        return ["full_attention" if r else "sliding_attention" for r in _rope_layers(cfg, num_layers)]
    return ["full_attention"] * num_layers


def _rope_layers(cfg: dict, num_layers: int) -> tuple[bool, ...]:
    """SmolLM3: whether each layer applies rope (no_rope_layers: 1 rope, 0 none), by default
    none every no_rope_layer_interval-th layer, as transformers derives it."""
    if cfg.get("no_rope_layers") is not None:
        return tuple(bool(r) for r in cfg["no_rope_layers"])
    interval = cfg.get("no_rope_layer_interval") or 4
    return tuple((i + 1) % interval != 0 for i in range(num_layers))


def _rope_config(cfg: dict, layer_type: str | None = None) -> RopeConfig:
    """layer_type: the key of a rope_parameters given per layer type (Gemma 3's full_attention
    and sliding_attention; older Gemma 3 configs: rope_theta and rope_local_base_freq)."""
    # transformers >= 5 writes rope_parameters (theta included); older configs rope_theta + rope_scaling
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        params = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    else:
        params.update(cfg.get("rope_scaling") or {})
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported (rope over the whole head only)")
    if kind == "default":
        return RopeConfig(theta=float(theta))
    if kind == "yarn":
        factor = params.get("factor")
        original = int(params.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        factor = float(factor if factor is not None else cfg["max_position_embeddings"] / original)
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            get_mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
            if mscale and mscale_all_dim:
                attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            else:
                attention_factor = get_mscale(factor)
        return RopeConfig(
            theta=float(theta),
            type=kind,
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(attention_factor),
        )
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
    import torch  # here: the HTTP workers and the detokenizer read ModelConfig without torch

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
    if rope.type == "yarn":  # transformers' _compute_yarn_parameters
        dim, base = head_dim, rope.theta

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(base)
            )

        low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        extrapolation = 1 - ramp
        return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq
