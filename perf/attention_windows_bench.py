"""Sliding-window attention benchmark: one layer's attention on Gemma 3 270M's shapes (4 query
heads, 1 kv head, head_dim 256, pages of 16, fp32 cache) at a 4096-token context, full and on a
512-key window, soft-capped or not, through the cpu backend (gpu/kernels/attention_cpu.c) and
the torch backend (which Gemma ran on before the C kernels took windows); every configuration
in each round, interleaved, best of --repeat.

Steps: decode of --batches requests, each at the context; extend of one request's 512 new
tokens after a cached prefix (a chunk of a long prompt). The time is a forward() call: the
new tokens' K and V stored, then attended. It is this process's CPU time, which the other jobs
of a shared 2-core machine disturb far less than the wall clock (a call preempted midway is not
charged for the wait); at --threads 1, the default, that is the call's time on one core. The
wall time is beside it.

    python -m perf.attention_windows_bench [--batches 1,8] [--repeat 5] [--threads N]
    # writes perf/results/attention_windows.json and .md
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from gpu.attention import create_backend
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kvcache.kv_cache import KVCache
from perf import report

HQ, HKV, D, PAGE, CONTEXT, WINDOW, CAP, EXTEND = 4, 1, 256, 16, 4096, 512, 50.0, 512
# (backend, window, soft-cap)
CONFIGS = [("torch", WINDOW, None), ("cpu", None, None), ("cpu", WINDOW, None), ("cpu", WINDOW, CAP)]


def _step(q_lens: list[int], kv: KVCache, rng: np.random.Generator):
    """One step of requests at CONTEXT tokens, each adding q_lens[b] of them, pages scattered."""
    per = -(-CONTEXT // PAGE)
    pages = rng.permutation(kv.num_pages)[: per * len(q_lens)].astype(np.int32).reshape(len(q_lens), per)
    seqs = [SeqInput(b, np.zeros(n, np.int32), CONTEXT - n, pages[b], True) for b, n in enumerate(q_lens)]
    meta = build_forward_batch(seqs, PAGE, context_length=CONTEXT, device=torch.device("cpu")).meta
    T = meta.num_tokens
    q = torch.randn(T, HQ + 2 * HKV, D)[:, :HQ]  # a slice, as of the model's fused qkv
    return meta, q, torch.randn(T, HKV, D), torch.randn(T, HKV, D)


def _forward_us(backend, meta, q, k, v, calls: int) -> tuple[float, float]:
    """µs of CPU time and of wall time per forward() call"""
    backend.plan(meta)
    backend.forward(q, k, v, 0)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        backend.forward(q, k, v, 0)
    return (time.process_time() - cpu) / calls * 1e6, (time.perf_counter() - wall) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--repeat", type=int, default=5, help="rounds; the best of each is kept")
    ap.add_argument("--threads", type=int, default=1)
    report.add_arguments(ap, "attention_windows")
    args = ap.parse_args()
    started = report.start(args)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    kv = KVCache(1, max(batches) * -(-CONTEXT // PAGE) + 8, PAGE, HKV, D, torch.float32, torch.device("cpu"))
    kv.buffer.copy_(torch.randn(kv.buffer.shape))
    backends = {}
    for name, window, cap in CONFIGS:
        backends[name, window, cap] = create_backend(name, kv, HQ)
        backends[name, window, cap].configure(D**-0.5, (window,), cap)
    steps = [(f"decode B={B}", _step([1] * B, kv, rng), max(4, 64 // B)) for B in batches]
    steps.append((f"extend {EXTEND} new", _step([EXTEND], kv, rng), 2))
    best = {(s, c): (float("inf"), float("inf")) for s, _, _ in steps for c in CONFIGS}
    for _ in range(args.repeat):
        for step, batch, calls in steps:
            for c in CONFIGS:
                cpu, wall = _forward_us(backends[c], *batch, calls)
                best[step, c] = (min(best[step, c][0], cpu), min(best[step, c][1], wall))
    rows = [
        {
            "step": step,
            "backend": c[0],
            "window": c[1],
            "softcap": c[2],
            "cpu_us_per_layer": best[step, c][0],
            "wall_us_per_layer": best[step, c][1],
        }
        for step, _, _ in steps
        for c in CONFIGS
    ]
    full = {step: best[step, ("cpu", None, None)][0] for step, _, _ in steps}
    md = "\n".join(
        [
            f"threads={args.threads} load_avg={os.getloadavg()[0]:.1f}; one layer's attention (forward(): store "
            f"the new K, V, attend) at a {CONTEXT}-token context, Gemma 3 270M's heads; the process's CPU time "
            f"(and the wall clock's) per call, best of {args.repeat}",
            "",
            report.table(
                ["step", "backend", "window", "softcap", "CPU µs per layer", "wall µs", "cpu full / this (CPU)"],
                [
                    [r["step"], r["backend"], r["window"], r["softcap"], report.fmt(r["cpu_us_per_layer"])]
                    + [report.fmt(r["wall_us_per_layer"]), report.fmt(full[r["step"]] / r["cpu_us_per_layer"], ".2f")]
                    for r in rows
                ],
            ),
        ]
    )
    print(md)
    paths = report.write_results(
        "attention_windows",
        {"config": {"threads": args.threads, "repeat": args.repeat}, "rows": rows},
        md,
        started,
        out=args.out,
    )
    print("wrote " + " and ".join(map(str, paths)))


if __name__ == "__main__":
    main()
