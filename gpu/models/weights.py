"""The weights the model uses, by the same names from either source: an HF directory's
safetensors shards read into fused tensors (q/k/v stacked into one qkv projection, gate/up
into one gate_up projection; Phi-3 ships them fused already; Gemma's norm weights w stored as
1 + w, the scale its norms apply), or a GGUF file's tensors used in place in its mapping
(load_gguf_weights: the projections and the embedding as GGUFWeights, a fused one the list of
its tensors; norms and biases the file's F32 tensors)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gpu.models.gguf_layout import gguf_layout
from gpu.models.model_config import ModelConfig
from gpu.models.model_files import ModelLoadError
from gpu.quant.gguf_weight import GGUFWeight, mapped_tensor

Weight = torch.Tensor | GGUFWeight


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read weights {path}: {str(e).splitlines()[0]}") from None
    return tensors


def load_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Fused tensors named embed, norm, lm_head (absent when tied) and layers.{i}.{input_norm,
    qkv, qkv_bias, o, post_norm, gate_up, down}, plus q_norm, k_norm (cfg.qk_norm) and
    attn_out_norm, mlp_out_norm (cfg.gemma_norms: post_norm is then the pre-MLP norm), in
    dtype on device."""
    raw = read_safetensors(cfg.model_dir)
    D, Hq, Hkv, H = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads, cfg.hidden_size

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = raw.pop(name, None)
        if t is None:
            raise ModelLoadError(f"{cfg.model_dir}: weight {name} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"{cfg.model_dir}: weight {name} has shape {tuple(t.shape)}, config.json implies {shape}"
            )
        return t.to(device=device, dtype=dtype)

    def norm(name: str, size: int) -> torch.Tensor:
        # Gemma's RMSNorm scales by 1 + w, computed in float32 as transformers does
        if not cfg.gemma_norms:
            return take(name, (size,))
        return (1.0 + take(name, (size,)).float()).to(dtype)

    fused = cfg.architecture == "Phi3ForCausalLM"
    out = {"embed": take("model.embed_tokens.weight", (cfg.vocab_size, H)), "norm": norm("model.norm.weight", H)}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = take("lm_head.weight", (cfg.vocab_size, H))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.input_norm"] = norm(p + "input_layernorm.weight", H)
        if cfg.gemma_norms:
            out[f"layers.{i}.attn_out_norm"] = norm(p + "post_attention_layernorm.weight", H)
            out[f"layers.{i}.post_norm"] = norm(p + "pre_feedforward_layernorm.weight", H)
            out[f"layers.{i}.mlp_out_norm"] = norm(p + "post_feedforward_layernorm.weight", H)
        else:
            out[f"layers.{i}.post_norm"] = norm(p + "post_attention_layernorm.weight", H)
        if cfg.qk_norm:
            out[f"layers.{i}.q_norm"] = norm(p + "self_attn.q_norm.weight", D)
            out[f"layers.{i}.k_norm"] = norm(p + "self_attn.k_norm.weight", D)
        if fused:
            out[f"layers.{i}.qkv"] = take(p + "self_attn.qkv_proj.weight", ((Hq + 2 * Hkv) * D, H))
        else:
            out[f"layers.{i}.qkv"] = torch.cat(
                [
                    take(p + "self_attn.q_proj.weight", (Hq * D, H)),
                    take(p + "self_attn.k_proj.weight", (Hkv * D, H)),
                    take(p + "self_attn.v_proj.weight", (Hkv * D, H)),
                ]
            )
        if cfg.qkv_bias:
            out[f"layers.{i}.qkv_bias"] = torch.cat(
                [
                    take(p + "self_attn.q_proj.bias", (Hq * D,)),
                    take(p + "self_attn.k_proj.bias", (Hkv * D,)),
                    take(p + "self_attn.v_proj.bias", (Hkv * D,)),
                ]
            )
        out[f"layers.{i}.o"] = take(p + "self_attn.o_proj.weight", (H, Hq * D))
        if fused:  # Phi-3's gate_up_proj: gate rows, then up rows, as ours
            out[f"layers.{i}.gate_up"] = take(p + "mlp.gate_up_proj.weight", (2 * cfg.intermediate_size, H))
        else:
            out[f"layers.{i}.gate_up"] = torch.cat(
                [
                    take(p + "mlp.gate_proj.weight", (cfg.intermediate_size, H)),
                    take(p + "mlp.up_proj.weight", (cfg.intermediate_size, H)),
                ]
            )
        out[f"layers.{i}.down"] = take(p + "mlp.down_proj.weight", (H, cfg.intermediate_size))
    # a tied checkpoint may still carry lm_head.weight (a copy of the embedding); rotary buffers are recomputed
    leftover = [n for n in raw if n != "lm_head.weight" and not n.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise ModelLoadError(f"{cfg.model_dir}: unexpected weights for {cfg.architecture}, e.g. {leftover[0]}")
    return out


def load_gguf_weights(cfg: ModelConfig, activations: str) -> tuple[dict[str, Weight], str]:
    """load_weights' names from cfg.gguf_path's tensors, used in place: (weights, rope style
    "pairs" | "halves": how the file's q/k rows hold each rotary pair). Projections, the
    embedding and the LM head are GGUFWeights multiplied with `activations` ("f32" | "q8");
    norms (Gemma's already 1 + w, as llama.cpp's converter stores them) and biases float32.
    ModelLoadError names a missing tensor, a shape config.json does not imply, or a type no
    kernel takes (gpu/models/gguf_layout.py)."""
    layout = gguf_layout(cfg)
    out: dict[str, Weight] = {name: GGUFWeight(list(parts), activations) for name, parts in layout.matrices.items()}
    for name, parts in layout.vectors.items():
        values = [mapped_tensor(t.values()).float() for t in parts]  # F32: the mapping itself
        out[name] = values[0] if len(values) == 1 else torch.cat(values)
    return out, layout.rope_style
