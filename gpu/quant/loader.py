"""What `--quantization gguf` / `gguf-q8` loads: a GGUF model's projections read from the
file as blocks (gpu/quant/blocks.py), cached beside its converted directory. Embeddings, norms
and biases stay the fp32 tensors of load_weights."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from gpu.models.model_config import ModelConfig
from gpu.models.model_files import ModelLoadError
from gpu.quant.blocks import QuantizedWeight, ggml_cpu

# GGML type name -> (bytes of a block in the file, bytes of its quantized values)
FORMATS = {"Q4_1": (20, 16), "Q8_0": (34, 32)}
# --quantization value -> how the kernels take the activations
ACTIVATIONS = {"gguf": "fp32", "gguf-q8": "q8"}
# what --quantization auto runs a GGUF model in where the kernels can (gpu/model_runner.py
# resolve_quantization): the fastest mode within the quality bound (perf/results/quality.md)
AUTO_QUANTIZATION = "gguf-q8"
QUANTIZED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")  # whose GGUF tensors load_quantized reads


def load_quantized(gguf_path: Path, cfg: ModelConfig, activations: str = "fp32") -> dict[str, QuantizedWeight]:
    """The quantized replacements of load_weights()' qkv, o, gate_up, down and lm_head (their
    `dense` copies not attached), multiplied with `activations` ("fp32" | "q8"). The first
    start reads them from the GGUF (gguf-py parses every metadata field, the whole vocabulary
    included: slow) and caches them beside its converted directory; later starts read that."""
    if cfg.architecture not in QUANTIZED_ARCHITECTURES:
        raise ModelLoadError(f"--quantization gguf supports Llama and Mistral GGUF files, not {cfg.architecture}")
    ggml_cpu()  # built now: a missing compiler fails the start, not the first request
    cached = blocks_cache(cfg.model_dir)
    weights = _read_blocks(cached) if cached.is_file() else None
    if weights is None:
        weights = _blocks_from_gguf(gguf_path, cfg)
        _write_blocks(cached, weights)
    return {name: w.with_activations(activations) for name, w in weights.items()}


def blocks_cache(converted: Path) -> Path:
    """Where load_quantized keeps a GGUF's blocks: beside its converted directory (the
    model_dir of its ModelConfig, named by the file's content hash), not in it (the
    *.safetensors there are the fp32 weights)."""
    return converted.with_name(f"{converted.name}-blocks.safetensors")


def _blocks_from_gguf(gguf_path: Path, cfg: ModelConfig) -> dict[str, QuantizedWeight]:
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}

    def take(name: str) -> QuantizedWeight:
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(f"{gguf_path}: tensor {name} is missing")
        if t.tensor_type.name not in FORMATS:
            raise ModelLoadError(
                f"--quantization gguf: {name} is {t.tensor_type.name}; the CPU kernels take {', '.join(FORMATS)}"
            )
        return from_blocks(t.tensor_type.name, t.data)

    out = {"lm_head": take("output.weight" if "output.weight" in tensors else "token_embd.weight")}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out[f"layers.{i}.qkv"] = concat_rows(
            [
                unpermute_rows(take(p + "attn_q.weight"), cfg.num_q_heads),
                unpermute_rows(take(p + "attn_k.weight"), cfg.num_kv_heads),
                take(p + "attn_v.weight"),
            ]
        )
        out[f"layers.{i}.o"] = take(p + "attn_output.weight")
        out[f"layers.{i}.gate_up"] = concat_rows([take(p + "ffn_gate.weight"), take(p + "ffn_up.weight")])
        out[f"layers.{i}.down"] = take(p + "ffn_down.weight")
    return out


def _write_blocks(path: Path, weights: dict[str, QuantizedWeight]) -> None:
    """Atomically (a concurrent start reads the whole file or none); a read-only cache is skipped."""
    from safetensors.torch import save_file

    tensors = {
        f"{name}.{part}": getattr(w, part).contiguous() for name, w in weights.items() for part in ("qs", "d", "m")
    }
    kinds = json.dumps({name: w.kind for name, w in weights.items()})
    try:
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    except OSError:  # a read-only cache: every start reads the GGUF
        return
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"kinds": kinds})
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _read_blocks(path: Path) -> dict[str, QuantizedWeight] | None:
    """None when the file is not what _write_blocks wrote (then the GGUF is read again)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            kinds = json.loads((f.metadata() or {})["kinds"])
            return {
                name: QuantizedWeight(kind, *(f.get_tensor(f"{name}.{part}") for part in ("qs", "d", "m")))
                for name, kind in kinds.items()
            }
    except Exception:  # truncated or foreign file: not worth failing the start over
        return None


def from_blocks(kind: str, raw: np.ndarray) -> QuantizedWeight:
    """raw: uint8 [N, bytes of a row] as gguf.GGUFReader gives a tensor's data."""
    block_bytes, q_bytes = FORMATS[kind]
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], -1, block_bytes)  # [N, nb, block]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        m = np.zeros_like(d)
    qs = np.ascontiguousarray(blocks[..., block_bytes - q_bytes :])
    return QuantizedWeight(kind, torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(m))


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight whose rows are the parts' rows in order (q, k, v -> qkv)."""
    kinds = {p.kind for p in parts}
    if len(kinds) != 1:
        raise ModelLoadError(f"--quantization gguf: cannot fuse projections of types {sorted(kinds)}")
    qs, d, m = (torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m"))
    return QuantizedWeight(parts[0].kind, qs, d, m)


def unpermute_rows(w: QuantizedWeight, n_head: int) -> QuantizedWeight:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head's rows;
    transformers undoes it when it reads a GGUF (reverse_permute_weights), so do we."""
    N = w.shape[0]
    # out row (h, s, j) <- in row (h, j, s)
    order = torch.arange(N).reshape(n_head, N // n_head // 2, 2).transpose(1, 2).reshape(N)
    return QuantizedWeight(w.kind, w.qs[order].contiguous(), w.d[order].contiguous(), w.m[order].contiguous())
