"""Decode steps of a GGUF-quantized model on the CPU with its layer loop in C
(gpu/kernels/decode_cpu.c): the same kernels as the Python forward, in the same order, one
call a step instead of ~10 a layer, for every variation the forward runs (q/k norms, Gemma's
norms and GELU, per-layer rope tables, sliding windows, soft-capped scores). Used by the
ModelRunner for steps where every request has one new token, when the model's projections are
all GGUF blocks (GGUFWeights of block types), the per-layer glue is the C kernels (CpuLayerOps)
and the attention backend is `cpu`; anything else takes the Python forward. Steps with LoRA
adapters' tokens get their deltas in the loop too (decode_cpu.c's lora_add), from each resident
adapter's table of pairs (gpu/lora.py's Adapter.table)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from gpu import kernels
from gpu.attention.base import AttentionMetadata
from gpu.attention.cpu import KV_DTYPE_CODES
from gpu.kvcache.kv_cache import KVCache
from gpu.models.llama import CpuLayerOps, LlamaForCausalLM
from gpu.quant.gguf_weight import GGUFWeight, WeightPart

if TYPE_CHECKING:
    from gpu.lora import LoraBatch

MAX_PARTS = 3  # decode_cpu.c's: q, k, v


class _Part(ctypes.Structure):
    _fields_ = [
        ("gemm", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("few_gemm", ctypes.c_void_p),  # WeightPart.in_place's, for fewer than few_below tokens
        ("few_w", ctypes.c_void_p),
        ("few_below", ctypes.c_int64),
    ]


class _Projection(ctypes.Structure):
    _fields_ = [
        ("parts", _Part * MAX_PARTS),
        ("n_parts", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("cos_table", ctypes.c_void_p),
        ("sin_table", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("qkv", _Projection),
        ("o", _Projection),
        ("gate_up", _Projection),
        ("down", _Projection),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("gated", ctypes.c_void_p),  # gate_up's act(gate) * up in one product, or None
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("q_heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("kv_dtype", ctypes.c_int64),
        ("rope_pairs", ctypes.c_int64),
        ("gelu", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
    ]


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _in_blocks(w: torch.Tensor | GGUFWeight) -> bool:
    """Whether every part of w goes through a block kernel (which the C loop calls)."""
    return isinstance(w, GGUFWeight) and len(w.parts) <= MAX_PARTS and all(p.kernels is not None for p in w.parts)


def _part(p: WeightPart, activations: str) -> _Part:
    """p's product, and the product of its blocks below in_place_below tokens (WeightPart.for_tokens)."""
    few = p.for_tokens(0)  # p itself where it keeps no blocks: few_below 0 never takes it
    assert p.kernels is not None and few.kernels is not None
    return _Part(
        p.kernels.gemm_addresses[activations],
        p.address,
        p.rows,
        few.kernels.gemm_addresses[activations],
        few.address,
        p.in_place_below,
    )


def _projection(w: torch.Tensor | GGUFWeight) -> _Projection:
    if not isinstance(w, GGUFWeight) or not _in_blocks(w):
        raise TypeError("the C decode loop runs projections in GGUF blocks only")
    parts = [_part(p, w.activations) for p in w.parts if p.kernels is not None]
    n, k = w.shape
    return _Projection((_Part * MAX_PARTS)(*parts), len(parts), n, k)


def _gated(w: torch.Tensor | GGUFWeight) -> int | None:
    """The address of w's one product of act(gate) * up (GGUFWeight.gated's), or None."""
    kernels = w.gating if isinstance(w, GGUFWeight) else None
    return None if kernels is None else kernels.gated_address or None


class CpuDecoder:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        """Raises KernelBuildError when the library cannot be built here."""
        lib = kernels.load("decode_cpu", "layer_cpu", "attention_cpu")
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        # layers, n_layers, dims, T, x, residual, positions, out_cache_loc, page_table, pt_stride, kv_lens,
        # loras, lora_max_r, threads
        lib.decode_layers.argtypes = [
            *(ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr),
            *(ptr, i64, ctypes.c_int),
        ]
        lib.decode_layers.restype = ctypes.c_int
        self._decode = lib.decode_layers
        cfg, ops = model.cfg, model.ops
        self.model = model
        windows = cfg.sliding_windows or (None,) * cfg.num_layers
        self._layers = (_Layer * cfg.num_layers)(
            *(
                _Layer(
                    model.input_norm[i].data_ptr(),
                    model.post_norm[i].data_ptr(),
                    _address(model.qkv_bias[i]),
                    _address(model.q_norm[i]),
                    _address(model.k_norm[i]),
                    _address(model.attn_out_norm[i]),
                    _address(model.mlp_out_norm[i]),
                    None if (rope := model.layer_rope[i]) is None else rope.cos.data_ptr(),
                    None if rope is None else rope.sin.data_ptr(),
                    windows[i] or 0,
                    _projection(model.qkv[i]),
                    _projection(model.o[i]),
                    _projection(model.gate_up[i]),
                    _projection(model.down[i]),
                    kv_cache.k[i].data_ptr(),
                    kv_cache.v[i].data_ptr(),
                    _gated(model.gate_up[i]),
                )
                for i in range(cfg.num_layers)
            )
        )
        intermediate = model.gate_up[0].shape[0] // 2
        self._dims = _Dims(
            cfg.hidden_size,
            intermediate,
            cfg.num_q_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_cache.page_size,
            KV_DTYPE_CODES[kv_cache.dtype],
            int(ops.rope_style == "pairs"),
            int(cfg.hidden_act != "silu"),
            cfg.rms_norm_eps,
            cfg.attn_scale,
            cfg.attn_logit_softcapping or 0.0,
        )

    @staticmethod
    def applies(model: LlamaForCausalLM, attention_backend: str) -> bool:
        """Whether `model` run with `attention_backend` is one this decoder reproduces."""
        projections = (*model.qkv, *model.o, *model.gate_up, *model.down)
        return (
            attention_backend == "cpu"
            and all(isinstance(ops, CpuLayerOps) for ops in (model.ops, *model.layer_rope) if ops is not None)
            and all(_in_blocks(w) for w in projections)
        )

    def takes(self, meta: AttentionMetadata) -> bool:
        """A decode step."""
        return meta.is_decode

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
        lora: LoraBatch | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: int64 [T] -> float32 logits [S, V], as LlamaForCausalLM.forward (with the
        deltas of `lora`'s adapters for their tokens; in `out`, as its logits() says)."""
        loras, max_r = lora.tables if lora is not None else (None, 0)
        x = self.model.scaled_embedding(input_ids).contiguous()  # [T, H], the residual stream
        residual = torch.empty_like(x)
        page_table = meta.page_table if meta.page_table.is_contiguous() else meta.page_table.contiguous()
        if self._decode(
            ctypes.addressof(self._layers),
            len(self._layers),
            ctypes.addressof(self._dims),
            x.shape[0],
            x.data_ptr(),
            residual.data_ptr(),
            meta.positions.data_ptr(),
            meta.out_cache_loc.data_ptr(),
            page_table.data_ptr(),
            page_table.shape[1],
            meta.kv_lens.data_ptr(),
            None if loras is None else loras.ctypes.data,
            max_r,
            torch.get_num_threads(),
        ):
            raise MemoryError("decode_cpu: no memory for a step's activations")
        return self.model.logits(x, residual, logits_index, out)
