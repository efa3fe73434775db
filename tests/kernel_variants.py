"""The CPU kernel libraries built another way than the server loads them, so that the tests run
each path of a kernel file on one CPU: a build with a define that keeps it off the AVX-512 paths
(gguf_q32.c's GGUF_Q32_AVX2_ONLY, ggml_cpu.c's GGML_CPU_AVX2_ONLY), and the AVX-VNNI path on a
CPU with AVX512-VNNI (simd_math.h's RINGSERVE_AVX_VNNI_AS_EVEX: that path with its vpdpbusd in
the EVEX form such a CPU runs)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import pytest

from cbuild import build
from gpu import kernels


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(Path("/proc/cpuinfo").read_text().split())


def cpu_has_avx512_vnni() -> bool:
    """simd_math.h's cpu_has_avx512_vnni"""
    return {"avx512_vnni", "avx512vl", "avx512bw"} <= cpu_flags()


def built_with(stem: str, define: str) -> ctypes.CDLL:
    """gpu/kernels/<stem>.c built as kernels.load builds it, with `define` defined."""
    here = Path(kernels.__file__).parent
    flags = (*kernels.CFLAGS, f"-D{define}")
    return ctypes.CDLL(str(build(f"{stem}_{define.lower()}", [here / f"{stem}.c"], flags, sorted(here.glob("*.h")))))


def avx_vnni_library(stem: str) -> ctypes.CDLL:
    """gpu/kernels/<stem>.c as it runs on a CPU with AVX-VNNI and no AVX-512 (Intel's client
    cores): as loaded on such a CPU; built with RINGSERVE_AVX_VNNI_AS_EVEX on one with
    AVX512-VNNI; a skip on any other."""
    if cpu_has_avx512_vnni():
        return built_with(stem, "RINGSERVE_AVX_VNNI_AS_EVEX")
    if "avx_vnni" in cpu_flags():
        return kernels.load(stem)
    pytest.skip("the CPU has neither AVX-VNNI nor AVX512-VNNI")
