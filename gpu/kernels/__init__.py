"""The executor's kernels: triton (attention over the paged KV cache, CUDA or the
interpreter) and C for x86-64 CPUs with AVX2 + FMA (GGUF block products, paged decode
attention), built with the system C compiler on first use into the cache directory."""

from __future__ import annotations

import ctypes
import os
import shutil
import threading
from pathlib import Path

import torch

from cbuild import BuildError, build

CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_loaded: dict[str, ctypes.CDLL] = {}
_loading = threading.Lock()


def _avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class KernelBuildError(RuntimeError):
    """A C kernel cannot be built or run here; the message is one line."""


def cpu_kernels_available() -> bool:
    """An AVX2 CPU and a C compiler: what load() needs."""
    return _avx2() and shutil.which(os.environ.get("CC", "cc")) is not None


def load(name: str, *linked: str) -> ctypes.CDLL:
    """gpu/kernels/<name>.c, with the kernels of the `linked` sources it calls built into the
    same library, compiled once into the cache (keyed by sources and flags). Safe from several
    threads: every caller of a name gets the one CDLL (whose functions' argtypes are set once)."""
    lib = _loaded.get(name)
    if lib is not None:
        return lib
    path = build_library(name, *linked)
    with _loading:
        if name not in _loaded:
            _loaded[name] = ctypes.CDLL(str(path))
        return _loaded[name]


def build_library(name: str, *linked: str) -> Path:
    """load()'s library compiled into the cache (or found there), not loaded: what a thread
    building ahead of the model's load calls (gpu/model_runner.py)."""
    if not _avx2():
        raise KernelBuildError("the CPU kernels need an x86-64 CPU with AVX2 and FMA")
    here = Path(__file__).parent
    sources = [here / f"{name}.c", *(here / f"{n}.c" for n in linked)]
    try:
        return build(name, sources, CFLAGS, headers=sorted(here.glob("*.h")))  # headers: what the sources may include
    except BuildError as e:
        raise KernelBuildError(str(e)) from None
