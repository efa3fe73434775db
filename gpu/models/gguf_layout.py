"""Which tensors of a GGUF file make each weight the model uses, by gpu/models/weights.py's
names, checked against the config: a tensor missing, of a shape the config does not imply, of
a type no kernel takes, or left over is a ModelLoadError naming it. Torch-free: `serve`
checks a file with it before any server process loads it (runtime/__main__.py), and
load_gguf_weights builds the weights from it."""

from __future__ import annotations

from dataclasses import dataclass

from gpu.models.gguf_file import GGUFFile, GGUFTensor
from gpu.models.model_config import ModelConfig
from gpu.models.model_files import ModelLoadError
from gpu.quant.gguf_types import FLOAT_TYPES, block_type

# llama.cpp's converter interleaves the two rotary halves of each q/k head's rows for these
# architectures (LlamaModel.permute): their rope then rotates adjacent pairs (its NORM rope)
PAIRED_ROPE_ARCHITECTURES = ("llama", "smollm3")


@dataclass(frozen=True)
class GGUFLayout:
    """matrices: weight name -> its tensors, whose rows follow one another (a fused weight:
    q, k, v); vectors: norm or bias name -> its F32 / F16 / BF16 tensors, concatenated (the
    qkv bias). In the order the model's weights are named. rope_style: "pairs" | "halves",
    how the file's q/k rows hold each rotary pair."""

    file: GGUFFile
    matrices: dict[str, tuple[GGUFTensor, ...]]
    vectors: dict[str, tuple[GGUFTensor, ...]]
    rope_style: str


def gguf_layout(cfg: ModelConfig) -> GGUFLayout:
    if cfg.gguf_path is None:
        raise ModelLoadError(f"{cfg.model_dir}: not a GGUF model (no gguf.json)")
    file = GGUFFile(cfg.gguf_path)
    tensors = dict(file.tensors)
    D, Hq, Hkv, H, I = cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size
    matrices: dict[str, tuple[GGUFTensor, ...]] = {}
    vectors: dict[str, tuple[GGUFTensor, ...]] = {}

    def tensor(name: str, shape: tuple[int, ...]) -> GGUFTensor:
        t = tensors.pop(name, None)
        if t is None:
            raise ModelLoadError(f"{file.path}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{file.path}: tensor {name} has shape {tuple(t.shape)}, the config implies {shape}")
        return t

    def matrix(key: str, *parts: tuple[str, int], width: int = H) -> None:
        """The rows of the tensors named, [rows, width] each, one after another."""
        found = tuple(tensor(name + ".weight", (rows, width)) for name, rows in parts)
        for t in found:
            if t.type_name in FLOAT_TYPES:
                continue
            try:
                block = block_type(t.name, t.type_name)
            except ModelLoadError as e:
                raise ModelLoadError(f"{file.path}: {e}") from None
            if width % block.block_elements:
                raise ModelLoadError(
                    f"{file.path}: tensor {t.name}: its {width} columns are not whole {t.type_name} blocks"
                )
        matrices[key] = found

    def vector(key: str, *parts: tuple[str, int]) -> None:
        found = tuple(tensor(name, (size,)) for name, size in parts)
        for t in found:
            if t.type_name not in FLOAT_TYPES:
                raise ModelLoadError(
                    f"{file.path}: tensor {t.name} is {t.type_name}; a norm or bias is F32, F16 or BF16"
                )
        vectors[key] = found

    matrix("embed", ("token_embd", cfg.vocab_size))
    vector("norm", ("output_norm.weight", H))
    if "output.weight" in tensors:  # llama.cpp's converter leaves it out when it equals the embedding
        matrix("lm_head", ("output", cfg.vocab_size))
    elif not cfg.tie_word_embeddings:
        raise ModelLoadError(f"{file.path}: tensor output.weight is missing (the config does not tie it)")
    for i in range(cfg.num_layers):
        p, w = f"blk.{i}.", f"layers.{i}."
        vector(w + "input_norm", (p + "attn_norm.weight", H))
        if cfg.gemma_norms:
            vector(w + "attn_out_norm", (p + "post_attention_norm.weight", H))
            vector(w + "post_norm", (p + "ffn_norm.weight", H))
            vector(w + "mlp_out_norm", (p + "post_ffw_norm.weight", H))
        else:
            vector(w + "post_norm", (p + "ffn_norm.weight", H))
        if cfg.qk_norm:
            vector(w + "q_norm", (p + "attn_q_norm.weight", D))
            vector(w + "k_norm", (p + "attn_k_norm.weight", D))
        if p + "attn_qkv.weight" in tensors:  # Phi-3's fused projection
            matrix(w + "qkv", (p + "attn_qkv", (Hq + 2 * Hkv) * D))
        else:
            matrix(w + "qkv", (p + "attn_q", Hq * D), (p + "attn_k", Hkv * D), (p + "attn_v", Hkv * D))
        if cfg.qkv_bias:
            biases = (p + "attn_q.bias", Hq * D), (p + "attn_k.bias", Hkv * D), (p + "attn_v.bias", Hkv * D)
            vector(w + "qkv_bias", *biases)
        matrix(w + "o", (p + "attn_output", H), width=Hq * D)
        if p + "ffn_gate.weight" in tensors:
            matrix(w + "gate_up", (p + "ffn_gate", I), (p + "ffn_up", I))
        else:  # Phi-3's ffn_up holds the gate rows, then the up rows
            matrix(w + "gate_up", (p + "ffn_up", 2 * I))
        matrix(w + "down", (p + "ffn_down", H), width=I)
    # rope_freqs / rope_factors_* are llama.cpp's precomputed rope scaling, which the config holds
    leftover = [n for n in tensors if not n.startswith("rope_")]
    if leftover:
        raise ModelLoadError(f"{file.path}: unexpected tensors for {cfg.architecture}, e.g. {leftover[0]}")
    return GGUFLayout(file, matrices, vectors, "pairs" if file.architecture in PAIRED_ROPE_ARCHITECTURES else "halves")
