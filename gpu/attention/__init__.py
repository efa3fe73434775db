"""Attention backends by name; each is imported only when chosen (flashinfer and triton
are optional on the CPU)."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from gpu.attention.base import AttentionBackend, AttentionMetadata
from gpu.kvcache.kv_cache import KVCache

BACKENDS = {
    "torch": ("gpu.attention.torch_native", "TorchNativeBackend"),
    "cpu": ("gpu.attention.cpu", "CpuBackend"),
    "triton": ("gpu.attention.triton", "TritonBackend"),
    "flashinfer": ("gpu.attention.flashinfer", "FlashInferBackend"),
}


def default_backend(device: torch.device, plain_attention: bool = True) -> str:
    """The backend a model runs with when none is asked for; plain_attention: False where the
    model has sliding windows or soft-capped scores (ModelConfig.plain_attention), which on
    CUDA only the torch backend runs."""
    if device.type != "cuda":
        from gpu.kernels import cpu_kernels_available

        return "cpu" if cpu_kernels_available() else "torch"
    if not plain_attention:
        return "torch"
    return "flashinfer" if importlib.util.find_spec("flashinfer") else "triton"


def create_backend(name: str, kv_cache: KVCache, num_q_heads: int) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend must be one of {list(BACKENDS)}, not {name!r}")
    if name == "flashinfer" and kv_cache.device.type != "cuda":
        raise ValueError("--attention-backend flashinfer needs a CUDA device")
    module, cls = BACKENDS[name]
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"--attention-backend {name} is unavailable: {e}") from None
    return backend_cls(kv_cache, num_q_heads)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "create_backend", "default_backend"]
