"""The K-quant products of a Q4_K_M Llama (gpu/kernels/gguf_kquants.c's _q8 kernels) at the
shapes of Llama-3.2-1B and -3B, at decode and prefill token counts: this tree's kernel against
the kernel of an earlier commit (--base, built from its sources into the cache) and, given
--ggml-lib, llama.cpp's own (its libggml's MUL_MAT on the CPU backend, the weight in the
buffer type llama.cpp's loader puts it in: Q4_K repacked to its 8x8 interleaved layout, Q6_K
in the plain CPU buffer, as llama.cpp does on an AVX2 CPU).

    python -m perf.kquant_products_bench [--ggml-lib LLAMA_CPP/build/bin] [--tokens 1,8,32,512]

Where the CPU has AVX512-VNNI (gguf_kquants_packs()), Q4_K and Q6_K weights are packed once at
load and the products read the packed copy (gguf_gemm_TYPE_packed_q8): timed too, this tree's
and the base's, each on its own packing of the same blocks (the base must have them).

One thread, timed by the thread's own CPU time (best of --rounds, the kernels interleaved in
each round): on a machine other work shares, the cost of each product and not the waits for a
core. Weights are random blocks with moderate fp16 scales (perf/gguf_kernels_bench.py).
Writes perf/results/kquant_products.json and .md (perf/report.py)."""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cbuild import build
from gpu import kernels
from perf import report
from perf.gguf_kernels_bench import random_blocks

# (model, product, K, N): Llama-3.2-1B and -3B's distinct projections
SHAPES = (
    ("1B", "q, o", 2048, 2048),
    ("1B", "k, v", 2048, 512),
    ("1B", "gate, up", 2048, 8192),
    ("1B", "down", 8192, 2048),
    ("3B", "q, o", 3072, 3072),
    ("3B", "k, v", 3072, 1024),
    ("3B", "gate, up", 3072, 8192),
    ("3B", "down", 8192, 3072),
)
GGML_TYPES = {"Q4_K": 12, "Q6_K": 14}  # ggml.h's enum ggml_type
REPACKED = {"Q4_K"}  # the types llama.cpp's CPU backend repacks on an AVX2 CPU (ggml-cpu/repack.cpp)
ROOT = Path(__file__).resolve().parent.parent
Gemm = Callable[[int, int, int, int, int, int, int, int], int]


def kquant_gemms(lib: ctypes.CDLL, types: list[str]) -> dict[str, Gemm]:
    out = {}
    for name in types:
        fn = getattr(lib, f"gguf_gemm_{name.lower()}_q8")
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        out[name] = fn
    return out


def packed_gemms(lib: ctypes.CDLL, types: list[str]) -> dict[str, tuple[Callable, Gemm]]:
    """type -> (gguf_pack_<type>, gguf_gemm_<type>_packed_q8), for the types `lib` packs at load
    on this CPU (none without AVX512-VNNI)"""
    if not lib.gguf_kquants_packs():
        return {}
    out = {}
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name in types:
        pack = getattr(lib, f"gguf_pack_{name.lower()}", None)
        if pack is None:
            continue
        pack.argtypes, pack.restype = [ptr, i64, i64, ptr, ctypes.c_int], i64
        fn = getattr(lib, f"gguf_gemm_{name.lower()}_packed_q8")
        fn.argtypes, fn.restype = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int], ctypes.c_int
        out[name] = (pack, fn)
    return out


def packed_copy(pack: Callable, blocks: np.ndarray, N: int, K: int) -> np.ndarray:
    out = np.empty(pack(blocks.ctypes.data, N, K, None, 1), np.uint8)
    pack(blocks.ctypes.data, N, K, out.ctypes.data, 1)
    return out


def base_library(rev: str) -> ctypes.CDLL:
    """gguf_kquants.c as it was at `rev`, built with the kernels' flags"""
    with tempfile.TemporaryDirectory() as tmp:
        sources = []
        for name in ("gguf_kquants.c", "simd_math.h"):
            text = subprocess.run(
                ["git", "show", f"{rev}:gpu/kernels/{name}"], cwd=ROOT, check=True, capture_output=True
            ).stdout
            (Path(tmp) / name).write_bytes(text)
            sources.append(Path(tmp) / name)
        return ctypes.CDLL(str(build("gguf_kquants_base", sources[:1], kernels.CFLAGS, headers=sources[1:])))


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class Ggml:
    """llama.cpp's MUL_MAT through its libggml (the CPU backend, one thread)"""

    def __init__(self, lib_dir: Path) -> None:
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=mode)
        p = ctypes.c_void_p
        for lib, name, res, args in (
            (self.base, "ggml_init", p, [InitParams]),
            (self.base, "ggml_new_tensor_2d", p, [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
            (self.base, "ggml_mul_mat", p, [p, p, p]),
            (self.base, "ggml_new_graph", p, [p]),
            (self.base, "ggml_build_forward_expand", None, [p, p]),
            (self.base, "ggml_get_data", p, [p]),
            (self.base, "ggml_backend_alloc_ctx_tensors_from_buft", p, [p, p]),
            (self.base, "ggml_backend_tensor_set", None, [p, p, ctypes.c_size_t, ctypes.c_size_t]),
            (self.base, "ggml_backend_graph_compute", ctypes.c_int, [p, p]),
            (self.cpu, "ggml_backend_cpu_init", p, []),
            (self.cpu, "ggml_backend_cpu_set_n_threads", None, [p, ctypes.c_int]),
            (self.cpu, "ggml_backend_cpu_buffer_type", p, []),
            (self.cpu, "_Z35ggml_backend_cpu_repack_buffer_typev", p, []),  # C++: ggml_backend_cpu_repack_buffer_type()
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.backend = self.cpu.ggml_backend_cpu_init()
        self.cpu.ggml_backend_cpu_set_n_threads(self.backend, 1)
        self.kept: list[object] = []

    def product(self, type_name: str, blocks: np.ndarray, x: np.ndarray) -> Callable[[], None]:
        """y = x @ W^T for W the blocks of `type_name` [N, K]: a call computing it"""
        (T, K), N = x.shape, blocks.shape[0]
        b = self.base
        weights = b.ggml_init(InitParams(1 << 16, None, True))
        w = b.ggml_new_tensor_2d(weights, GGML_TYPES[type_name], K, N)
        buft = (
            self.cpu._Z35ggml_backend_cpu_repack_buffer_typev()
            if type_name in REPACKED
            else self.cpu.ggml_backend_cpu_buffer_type()
        )
        self.kept.append(b.ggml_backend_alloc_ctx_tensors_from_buft(weights, buft))
        b.ggml_backend_tensor_set(w, blocks.ctypes.data, 0, blocks.nbytes)  # repacked here, as at a model's load
        ctx = b.ggml_init(InitParams(4 * (T * K + T * N) + (1 << 20), None, False))
        xt = b.ggml_new_tensor_2d(ctx, 0, K, T)  # F32
        ctypes.memmove(b.ggml_get_data(xt), x.ctypes.data, x.nbytes)
        graph = b.ggml_new_graph(ctx)
        b.ggml_build_forward_expand(graph, b.ggml_mul_mat(ctx, w, xt))
        return lambda: self._compute(graph)

    def _compute(self, graph: int) -> None:
        if self.base.ggml_backend_graph_compute(self.backend, graph) != 0:
            raise RuntimeError("ggml_backend_graph_compute failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="f1fd0a6", help="the commit whose gguf_kquants.c is the baseline")
    ap.add_argument("--ggml-lib", type=Path, help="the folder of a llama.cpp build's libggml-base.so, libggml-cpu.so")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--tokens", default="1,8,32,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--round-ms", type=float, default=100.0)
    report.add_arguments(ap, "kquant_products")
    args = ap.parse_args()
    started = report.start(args)
    types, tokens = args.types.split(","), [int(t) for t in args.tokens.split(",")]
    new_lib, old_lib = kernels.load("gguf_kquants"), base_library(args.base)
    new, old = kquant_gemms(new_lib, types), kquant_gemms(old_lib, types)
    new_packed, old_packed = packed_gemms(new_lib, types), packed_gemms(old_lib, types)
    ggml = Ggml(args.ggml_lib) if args.ggml_lib else None
    rng = np.random.default_rng(0)
    rows = []
    for type_name in types:
        for model, product, K, N in SHAPES:
            blocks = random_blocks(rng, type_name, N, K)
            packed = {
                name: (fn, packed_copy(pack, blocks, N, K))
                for name, gemms in (("new packed", new_packed), ("base packed", old_packed))
                if type_name in gemms
                for pack, fn in [gemms[type_name]]
            }
            for T in tokens:
                x = rng.standard_normal((T, K)).astype(np.float32)
                y = np.empty((T, N), np.float32)

                def ours(fn: Gemm, w=blocks, T: int = T, K: int = K, N: int = N, x=x, y=y) -> Callable[[], None]:
                    return lambda: fn(x.ctypes.data, T, K, w.ctypes.data, N, y.ctypes.data, N, 1)

                calls = {"new": ours(new[type_name]), "base": ours(old[type_name])}
                calls.update({name: ours(fn, w) for name, (fn, w) in packed.items()})
                if ggml is not None:
                    calls["llama.cpp"] = ggml.product(type_name, blocks, x)
                best = {name: float("inf") for name in calls}
                for call in calls.values():
                    call()
                start = time.thread_time()
                calls["new"]()
                passes = max(1, int(args.round_ms / 1e3 / max(time.thread_time() - start, 1e-6)))
                for _ in range(args.rounds):
                    for name, call in calls.items():
                        start = time.thread_time()
                        for _ in range(passes):
                            call()
                        best[name] = min(best[name], (time.thread_time() - start) / passes)
                row = {"type": type_name, "model": model, "product": product, "K": K, "N": N, "T": T}
                row.update({f"{name} ms": s * 1e3 for name, s in best.items()})
                row["base / new"] = best["base"] / best["new"]
                if len(packed) == 2:
                    row["base packed / new packed"] = best["base packed"] / best["new packed"]
                if ggml is not None:
                    row["llama.cpp / new"] = best["llama.cpp"] / best["new"]
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    columns = [c for c in rows[0] if c not in ("K", "N")]
    table = report.table(
        ["K x N" if c == "product" else c for c in columns],
        [
            [
                f"{r['product']} {r['K']}x{r['N']}"
                if c == "product"
                else report.fmt(r[c], ".2f")
                if isinstance(r[c], float)
                else r[c]
                for c in columns
            ]
            for r in rows
        ],
    )
    notes = (
        f"\n\nOne thread; ms: the thread's CPU time a product, best of {args.rounds} rounds of "
        f"~{args.round_ms:.0f} ms, "
        "the kernels interleaved in each round. new: this tree's gguf_gemm_TYPE_q8 (x rounded to int8 per 32 "
        f"values), base: the same file at {args.base}; new packed, base packed: their "
        "gguf_gemm_TYPE_packed_q8 on the weight packed at load (AVX512-VNNI CPUs, Q4_K and Q6_K). "
        + (
            "llama.cpp: libggml's MUL_MAT (x rounded per 256 values, Q8_K), Q4_K in its repacked 8x8 layout "
            "(ggml_gemm_q4_K_8x8_q8_K), Q6_K in the plain CPU buffer (which ggml-cpu's tiled VNNI kernels take "
            f"from 32 tokens where the CPU has AVX512-VNNI), the build in {args.ggml_lib}. "
            if ggml is not None
            else ""
        )
        + "Ratios above 1: the new kernel takes less time."
    )
    paths = report.write_results(
        "kquant_products",
        {"base": args.base, "rounds": args.rounds, "round_ms": args.round_ms, "results": rows},
        table + notes,
        started,
        out=args.out,
    )
    print("wrote " + " and ".join(map(str, paths)))


if __name__ == "__main__":
    main()
