"""`--quantization gguf` and `gguf-q8`: the projections of a GGUF model kept in the file's
own Q4_1 / Q8_0 blocks and multiplied by gpu/kernels/ggml_cpu.c (AVX2 + FMA, built once with
the system C compiler into the cache directory by gpu/kernels/__init__.py), instead of the
fp32 copies the converter writes.

`gguf` (activations "fp32"): the values are the same (the kernel dequantizes exactly as
gguf-py does); only the order of each dot product's sums differs from fp32. A decode step then
reads ~5x fewer bytes of weights, which is what bounds it on a CPU at small batches.

`gguf-q8` (activations "q8"): as llama.cpp does, x is quantized per 32-block to int8 with a
scale once per product and each block's dot product is integer, the weights' rows interleaved
in groups of 8 for the kernel (with_activations); far fewer instructions per block, and the
numerics change by x's rounding (at most amax / 254 per value of a block of x). Faster than
MKL's fp32 at every size, so every product goes through it and no fp32 copy is kept.

Embeddings, norms and biases stay fp32.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu import kernels
from gpu.model_config import ModelConfig
from gpu.model_files import ModelLoadError

BLOCK = 32
# GGML type name -> (bytes of a block in the file, bytes of its quantized values)
FORMATS = {"Q4_1": (20, 16), "Q8_0": (34, 32)}
# --quantization value -> how the kernels take the activations
ACTIVATIONS = {"gguf": "fp32", "gguf-q8": "q8"}
# what --quantization auto runs a GGUF model in where the kernels can (gpu/model_runner.py
# resolve_quantization): the fastest mode within the quality bound (perf/results/quality.md)
AUTO_QUANTIZATION = "gguf-q8"
QUANTIZED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")  # whose GGUF tensors load_quantized reads
# (block type, activations) -> the kernel; all take (x, T, K, qs, d, m, N, y, threads)
GEMMS = {
    ("Q4_1", "fp32"): "gemm_q4_1",
    ("Q8_0", "fp32"): "gemm_q8_0",
    ("Q4_1", "q8"): "gemm_q4_1_q8",
    ("Q8_0", "q8"): "gemm_q8_0_q8",
}

# Up to this many tokens a product reads the blocks; beyond, the dense fp32 copy through MKL.
# fp32 activations: memory bound at few tokens (~5x fewer bytes than fp32), compute bound
# beyond, where MKL is as fast or faster: against gpu/llama.py's fp32 path the blocks' lead
# shrinks as tokens grow and is gone at this limit (docs/perf-notes.md). q8 activations: no
# limit, and no dense copy is kept: the integer kernel beat MKL at every size measured
# (perf/forward_bench.py --products), up to the default chunked prefill.
QUANTIZED_MAX_TOKENS: dict[str, int | None] = {"fp32": 32, "q8": None}
ROW_GROUP = 8  # rows the q8 kernels interleave (gpu/kernels/ggml_cpu.c ROWS)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight as N rows of K / 32 blocks: value = d * q + m (m = 0 for Q8_0). With
    activations "q8", qs, d and m hold the same values in the q8 kernels' order (with_activations)."""

    kind: str  # "Q4_1" | "Q8_0"
    qs: torch.Tensor  # uint8 [N, K / 32, 16 (two nibbles a byte) or 32 (int8)]
    d: torch.Tensor  # float32 [N, K / 32]
    m: torch.Tensor  # float32 [N, K / 32]
    dense: torch.Tensor | None = None  # float32 [N, K], the same values, for products of > max_tokens
    activations: str = "fp32"  # "fp32": x as it is | "q8": x quantized per 32-block (quantize_q8)

    def with_activations(self, activations: str) -> QuantizedWeight:
        """The same weight for the other kernels. For "q8" each group of 8 rows is interleaved 4
        bytes at a time, qs as [N/8, nb, bytes/4, 8, 4] and d, m as [N/8, nb, 8], so that one
        32-byte load holds the same 4 bytes of 8 rows; for "fp32" rows are one after another."""
        if activations not in QUANTIZED_MAX_TOKENS:
            raise ValueError(f"activations must be one of {list(QUANTIZED_MAX_TOKENS)}, not {activations!r}")
        if activations == self.activations:
            return self
        (N, nb, q_bytes), g = self.qs.shape, ROW_GROUP
        if N % g:
            raise ModelLoadError(f"--quantization gguf-q8: its kernels take weights of a multiple of {g} rows, not {N}")
        if activations == "q8":
            qs = self.qs.view(N // g, g, nb, q_bytes // 4, 4).permute(0, 2, 3, 1, 4)
            d, m = (t.view(N // g, g, nb).transpose(1, 2) for t in (self.d, self.m))
        else:
            qs = self.qs.view(N // g, nb, q_bytes // 4, g, 4).permute(0, 3, 1, 2, 4)
            d, m = (t.view(N // g, nb, g).transpose(1, 2) for t in (self.d, self.m))
        return dataclasses.replace(
            self, qs=qs.reshape(N, nb, q_bytes), d=d.reshape(N, nb), m=m.reshape(N, nb), activations=activations
        )

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def max_tokens(self) -> int | None:
        """The most tokens a product takes through the blocks, more through `dense`; None: all."""
        return QUANTIZED_MAX_TOKENS[self.activations]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32 [T, K] -> [T, N] = x @ W^T."""
        N, K = self.shape
        x = x.contiguous()
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"x: expected float32 [T, {K}], got {x.dtype} {tuple(x.shape)}")
        y = torch.empty(x.shape[0], N, dtype=torch.float32)
        gemm = getattr(_kernels(), GEMMS[self.kind, self.activations])
        if gemm(
            x.data_ptr(),
            x.shape[0],
            K,
            self.qs.data_ptr(),
            self.d.data_ptr(),
            self.m.data_ptr(),
            N,
            y.data_ptr(),
            torch.get_num_threads(),
        ):
            raise MemoryError(f"no memory for the int8 copy of x {tuple(x.shape)}")
        return y

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as gguf-py computes it."""
        if self.activations != "fp32":
            return self.with_activations("fp32").dequantize()
        q = self.qs.to(torch.int32) if self.kind == "Q4_1" else self.qs.view(torch.int8).to(torch.int32)
        if self.kind == "Q4_1":
            q = torch.cat([q & 0x0F, q >> 4], dim=-1)  # [N, nb, 32]: low nibbles are elements 0..15
        w = q.to(torch.float32) * self.d[..., None] + self.m[..., None]
        return w.reshape(self.shape)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: float32 [T, K] -> (q int8 [T, K], d float32 [T, K/32], s float32 [T, K/32]): per
    32-block, d = amax / 127, q = x * (127 / amax) rounded to nearest (even), s = d * sum(q),
    as llama.cpp's Q8_1; a block of zeros gives d = s = 0, q = 0."""
    T, K = x.shape
    if x.dtype != torch.float32 or not x.is_contiguous() or K % BLOCK:
        raise ValueError(
            f"x: expected contiguous float32 [T, K] with K a multiple of {BLOCK}, got {x.dtype} {tuple(x.shape)}"
        )
    q = torch.empty(T, K, dtype=torch.int8)
    d, s = torch.empty(T, K // BLOCK), torch.empty(T, K // BLOCK)
    _kernels().quantize_q8(x.data_ptr(), T, K, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


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
    return QuantizedWeight(parts[0].kind, *(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m")))


def unpermute_rows(w: QuantizedWeight, n_head: int) -> QuantizedWeight:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head's rows;
    transformers undoes it when it reads a GGUF (reverse_permute_weights), so do we."""
    N = w.shape[0]
    # out row (h, s, j) <- in row (h, j, s)
    order = torch.arange(N).reshape(n_head, N // n_head // 2, 2).transpose(1, 2).reshape(N)
    return QuantizedWeight(w.kind, w.qs[order].contiguous(), w.d[order].contiguous(), w.m[order].contiguous())


def load_quantized(gguf_path: Path, cfg: ModelConfig, activations: str = "fp32") -> dict[str, QuantizedWeight]:
    """The quantized replacements of load_weights()' qkv, o, gate_up, down and lm_head (their
    `dense` copies not attached), multiplied with `activations` ("fp32" | "q8"). The first
    start reads them from the GGUF (gguf-py parses every metadata field, the whole vocabulary
    included: slow) and caches them beside its converted directory; later starts read that."""
    if cfg.architecture not in QUANTIZED_ARCHITECTURES:
        raise ModelLoadError(f"--quantization gguf supports Llama and Mistral GGUF files, not {cfg.architecture}")
    _kernels()  # built now: a missing compiler fails the start, not the first request
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


@functools.cache
def _kernels() -> ctypes.CDLL:
    """gpu/kernels/ggml_cpu.c, built on first use (a failed build is not cached: it raises)."""
    try:
        lib = kernels.load("ggml_cpu")
    except kernels.KernelBuildError as e:
        raise ModelLoadError(f"--quantization gguf: {e}") from None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in GEMMS.values():  # x, T, K, qs, d, m, N, y, threads -> the q8 ones: 0 or -1 (no memory)
        gemm = getattr(lib, name)
        gemm.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
        gemm.restype = ctypes.c_int if name.endswith("_q8") else None
    lib.quantize_q8.argtypes = [ptr, i64, i64, ptr, ptr, ptr]  # x, T, K, q, d, s
    lib.quantize_q8.restype = None
    return lib
