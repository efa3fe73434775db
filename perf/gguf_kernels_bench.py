"""GGUF block kernels (gpu/kernels/gguf_kquants.c, gpu/kernels/gguf_q32.c: products straight
from a GGUF file's blocks) against the repacked Q4_1 kernel of --quantization gguf-q8
(gpu/quant/blocks.py's repack_q4_1, gpu/kernels/ggml_cpu.c's 8 interleaved rows) in the same
run: µs per product and GB/s of weights read, on Gemma-3-270M-shaped products at decode and
prefill token counts.

    python -m perf.gguf_kernels_bench [--tokens 1,8,64] [--modes q8,f32] [--threads N]

Every type of gpu/quant/gguf_types.py whose kernels its library exports is measured (a
library that is not there, or a type it lacks, is skipped); a shape whose K is not a multiple
of the type's block (256 for the K-quants) is skipped too. Weights are random blocks with moderate fp16 scales;
each product is timed as the best of --repeats rounds of enough calls to last ~--round-ms.
Writes perf/results/gguf_kernels.json and .md (perf/report.py)."""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from gpu.models.model_files import ModelLoadError
from gpu.quant.blocks import repack_q4_1
from gpu.quant.gguf_types import BLOCK_TYPES, type_kernels
from gpu.quant.gguf_weight import GGUFWeight, WeightPart
from perf import report

SHAPES = ((640, 2048), (2048, 640), (640, 1024))  # (K, N): Gemma 3 270M's up/gate, down, q
# GGUF type -> byte offsets of its blocks' fp16 scales (d, and m or dmin), given moderate values
SCALE_OFFSETS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}
BASELINE = "repacked Q4_1 (ggml_cpu.c)"


def random_blocks(rng: np.random.Generator, type_name: str, N: int, K: int) -> np.ndarray:
    """uint8 [N, row bytes]: random quants and scale bytes, moderate fp16 scales"""
    block = BLOCK_TYPES[type_name]
    blocks = rng.integers(0, 256, (N, K // block.block_elements, block.block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        scales = rng.uniform(1e-3, 1e-2, (*blocks.shape[:2], 1)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(N, -1)


def best_us(calls: Sequence[Callable[[], object]], repeats: int, round_ms: float) -> tuple[float, float]:
    """(wall, CPU) µs per call, each the best of `repeats` rounds, a round going through `calls`
    (the same product on as many copies of the weight) as many times as lasts ~round_ms. On a
    shared machine the CPU time of this process shows the work done, the wall time also the
    waits for a core."""
    for call in calls[:3]:
        call()
    t = time.perf_counter()
    for call in calls:
        call()
    passes = max(1, int(round_ms / 1e3 / max(time.perf_counter() - t, 1e-7)))
    wall = cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        for _ in range(passes):
            for call in calls:
                call()
        wall = min(wall, (time.perf_counter() - t) / (passes * len(calls)))
        cpu = min(cpu, (time.process_time() - c) / (passes * len(calls)))
    return wall * 1e6, cpu * 1e6


def baseline_calls(
    rng: np.random.Generator, x: torch.Tensor, N: int, y: torch.Tensor, threads: int, copies: int
) -> tuple[list, list]:
    """The kernel of --quantization gguf-q8 on `copies` Q4_1 weights repacked as the loader
    repacks them (gpu/quant/blocks.py): (the calls, the weights, to be kept while they run)"""
    T, K = x.shape
    kept = []
    for _ in range(copies):
        blocks = random_blocks(rng, "Q4_1", N, K)
        part = WeightPart("baseline", "Q4_1", N, 0, blocks, blocks.ctypes.data, None, type_kernels("baseline", "Q4_1"))
        kept.append(repack_q4_1(GGUFWeight.of_parts((part,), (N, K), "q8")).parts[0])
    return [
        functools.partial(p.kernels.gemm["q8"], x.data_ptr(), T, K, p.address, N, y.data_ptr(), N, threads)
        for p in kept
    ], kept


def gguf_calls(fn: Callable, x: torch.Tensor, weight: np.ndarray, y: torch.Tensor, threads: int, copies: int):
    """fn on `copies` copies of the GGUF weight: (the calls, the copies, to be kept while they run)"""
    (T, K), N = x.shape, weight.shape[0]
    kept = np.tile(weight, (copies, 1)).reshape(copies, *weight.shape)
    calls = [functools.partial(fn, x.data_ptr(), T, K, w.ctypes.data, N, y.data_ptr(), N, threads) for w in kept]
    return calls, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,64", help="token counts T, comma-separated")
    ap.add_argument("--modes", default="q8,f32", help="the GGUF kernels' activations: q8 and/or f32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--round-ms", type=float, default=30.0)
    ap.add_argument(
        "--stream-mib",
        type=int,
        default=256,
        help="at T=1, also time the products over copies of the weight totalling this much, so each "
        "reads its weight from memory as a decode step does (0: not)",
    )
    report.add_arguments(ap, "gguf_kernels")
    args = ap.parse_args()
    tokens, modes = [int(t) for t in args.tokens.split(",")], args.modes.split(",")
    started = report.start(args)

    gemms: dict[str, dict[str, Callable]] = {}  # type -> mode -> its gemm
    skipped: list[str] = []
    for type_name in BLOCK_TYPES:
        try:
            found = type_kernels("(benchmark)", type_name)
        except (ModelLoadError, FileNotFoundError) as e:  # no such kernel, or its library is not there
            skipped.append(str(e))
            continue
        gemms[type_name] = {mode: found.gemm[mode] for mode in modes}

    rng = np.random.default_rng(0)
    rows = []

    def measure(name: str, mode: str, K: int, N: int, T: int, source: str, product: tuple, nbytes: int) -> None:
        us, cpu_us = best_us(product[0], args.repeats, args.round_ms)
        rows.append(
            {
                "type": name,
                "mode": mode,
                "K": K,
                "N": N,
                "T": T,
                "weights": source,
                "us": us,
                "cpu_us": cpu_us,
                "bytes": nbytes,
            }
        )

    for K, N in SHAPES:
        weights = {name: random_blocks(rng, name, N, K) for name in gemms if K % BLOCK_TYPES[name].block_elements == 0}
        for T in tokens:
            x, y = torch.randn(T, K), torch.empty(T, N)
            # (weights, MiB of copies to go through: None for one copy, kept in the caches)
            sources = [("cached", None)] + ([("streamed", args.stream_mib)] if T == 1 and args.stream_mib else [])
            for source, mib in sources:
                nbytes = N * K // 32 * (16 + 2 * 4)  # the baseline's nibbles, d and m
                copies = 1 if mib is None else -(-mib * 2**20 // nbytes)
                measure(BASELINE, "q8", K, N, T, source, baseline_calls(rng, x, N, y, args.threads, copies), nbytes)
                for name, w in weights.items():
                    copies = 1 if mib is None else -(-mib * 2**20 // w.nbytes)
                    for mode, fn in gemms[name].items():
                        product = gguf_calls(fn, x, w, y, args.threads, copies)
                        measure(name, mode, K, N, T, source, product, w.nbytes)
            print(f"K={K} N={N} T={T}: done", flush=True)

    base = {(r["K"], r["N"], r["T"], r["weights"]): r for r in rows if r["type"] == BASELINE}
    for r in rows:
        b = base[r["K"], r["N"], r["T"], r["weights"]]
        r["GB/s"] = r["bytes"] / r["us"] / 1e3
        r["GB/s vs baseline"] = r["GB/s"] / (b["bytes"] / b["us"] / 1e3)
        r["GB/s vs baseline, CPU time"] = r["bytes"] / r["cpu_us"] / (b["bytes"] / b["cpu_us"])
    columns = (
        "type",
        "mode",
        "K",
        "N",
        "T",
        "weights",
        "µs",
        "CPU µs",
        "weight KiB",
        "GB/s",
        "GB/s / baseline's",
        "the same by CPU time",
    )
    table = report.table(
        columns,
        [
            (
                r["type"],
                r["mode"],
                r["K"],
                r["N"],
                r["T"],
                r["weights"],
                report.fmt(r["us"]),
                report.fmt(r["cpu_us"]),
                report.fmt(r["bytes"] / 1024, ".0f"),
                report.fmt(r["GB/s"], ".2f"),
                report.fmt(r["GB/s vs baseline"], ".2f"),
                report.fmt(r["GB/s vs baseline, CPU time"], ".2f"),
            )
            for r in rows
        ],
    )
    print(table)
    notes = (
        f"\n\n{args.threads} threads; best of {args.repeats} rounds of ~{args.round_ms:.0f} ms (µs: wall time; "
        "CPU µs: this process's CPU time, all threads, a spinning one's too). GB/s (wall time): bytes of "
        "weights read per second (the GGUF blocks as in the file; the baseline's repacked Q4_1: 16 bytes of "
        f"nibbles and two float32 a 32-block). The baseline is {BASELINE}, the kernel of "
        "--quantization gguf-q8, measured in the same run. weights cached: one copy, called again and again, "
        f"so it stays in the caches; streamed: {args.stream_mib} MiB of copies called in turn, each read "
        "from memory, as in a decode step." + (f"\n\nSkipped: {'; '.join(skipped)}." if skipped else "")
    )
    paths = report.write_results(
        "gguf_kernels",
        {
            "threads": args.threads,
            "repeats": args.repeats,
            "round_ms": args.round_ms,
            "stream_mib": args.stream_mib,
            "skipped": skipped,
            "results": rows,
        },
        table + notes,
        started,
        out=args.out,
    )
    print("wrote " + " and ".join(map(str, paths)))


if __name__ == "__main__":
    main()
