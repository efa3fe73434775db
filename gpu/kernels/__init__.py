"""The executor's kernels: triton (attention over the paged KV cache, CUDA or the
interpreter) and C for x86-64 CPUs with AVX2 + FMA (GGUF block products, paged decode
attention), built with the system C compiler on first use into the cache directory."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from gpu.model_files import cache_root

CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_loaded: dict[str, ctypes.CDLL] = {}


def _avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


class KernelBuildError(RuntimeError):
    """A C kernel cannot be built or run here; the message is one line."""


def cpu_kernels_available() -> bool:
    """An AVX2 CPU and a C compiler: what load() needs."""
    return _avx2() and shutil.which(os.environ.get("CC", "cc")) is not None


def load(name: str, *linked: str) -> ctypes.CDLL:
    """gpu/kernels/<name>.c, with the kernels of the `linked` sources it calls built into the
    same library, compiled once into the cache (keyed by sources and flags)."""
    if name in _loaded:
        return _loaded[name]
    if not _avx2():
        raise KernelBuildError("the CPU kernels need an x86-64 CPU with AVX2 and FMA")
    here = Path(__file__).parent
    source_path = here / f"{name}.c"
    sources = [source_path, *(here / f"{n}.c" for n in linked)]
    headers = sorted(here.glob("*.h"))  # what the sources may include
    source = b"".join(p.read_bytes() for p in [*sources, *headers])
    key = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"{name}-{key}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        compiler = os.environ.get("CC", "cc")
        try:
            done = subprocess.run([compiler, *CFLAGS, "-o", tmp, *map(str, sources)], capture_output=True, text=True)
        except FileNotFoundError:
            os.unlink(tmp)
            raise KernelBuildError(f"the CPU kernels are built with a C compiler; {compiler} was not found "
                                   "(set CC)") from None
        if done.returncode != 0:
            os.unlink(tmp)
            first = (done.stderr.strip() or "?").splitlines()[0]
            raise KernelBuildError(f"building {source_path.name} failed: {first}")
        os.replace(tmp, path)
    _loaded[name] = lib = ctypes.CDLL(str(path))
    return lib
