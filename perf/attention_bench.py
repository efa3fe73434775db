"""Attention benchmark: the cpu backend (the C kernels reading pages in place) against the torch
backend (page gather + masked SDPA) on SmolLM2's shapes (30 layers, 9 query heads, 3 kv heads,
head_dim 64, pages of 16), same run, interleaved, best of --repeat; the two backends' outputs
are compared too.

--mode decode (default): one decode step's attention over all layers. Requests' pages either
follow one another in the pool or are scattered through it (a long-running server's pool); kv
lengths are ragged, as in a serving batch. Then whole decode steps of the real model (the
embedded SmolLM2, 128-token prompts), one ModelRunner per backend in this process, interleaved,
best of --repeat (--quantization gguf or gguf-q8: both on the GGUF's blocks).

--mode extend: one prefill step's attention over all layers, reported per layer, for each of
--shapes: BxN is B requests of N new tokens, BxN+P the same after a P-token cached prefix;
pages scattered through the pool.

--kv-cache-dtype float16 / bfloat16: the KV cache in that type, for every part.

    python -m perf.attention_bench [--threads N] [--batches 1,8,32] [--quantization gguf|gguf-q8]
                                   [--kv-cache-dtype auto|float16|bfloat16]
                                   # writes perf/results/attention.json and .md
    python -m perf.attention_bench --mode extend [--shapes 24x85,24x85+30,1x512] [--threads N]
                                   [--kv-cache-dtype ...]   # writes perf/results/attention_extend.json and .md
Prints the tables; the files are written by perf/report.py.
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
from gpu.model_runner import KV_CACHE_DTYPES, ModelRunner, ModelRunnerConfig
from gpu.quant.loader import ACTIVATIONS
from perf import report
from perf.forward_bench import ours_decoder

LAYERS, HQ, HKV, D, PAGE = 30, 9, 3, 64, 16
BACKENDS = ("torch", "cpu")


def step_seconds(backend, meta, q, k, v) -> float:
    t = time.perf_counter()
    backend.plan(meta)
    for layer in range(LAYERS):
        backend.forward(q, k, v, layer)
    return time.perf_counter() - t


def whole_steps(args: argparse.Namespace, batches: list[int]) -> list[dict]:
    steps = 8
    runners = {
        name: ModelRunner(
            ModelRunnerConfig(
                attention_backend=name,
                quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype,
                max_running_requests=max(batches),
                max_total_tokens=max(batches) * (args.context + 2 + steps * (args.repeat + 1) + 32),
            )
        )
        for name in BACKENDS
    }
    rng = np.random.default_rng(1)
    rows = []
    with torch.inference_mode():
        for B in batches:
            prompts = rng.integers(100, 20000, (B, args.context)).astype(np.int32)
            decoders = {name: ours_decoder(r, prompts, steps, args.repeat) for name, r in runners.items()}
            best = dict.fromkeys(BACKENDS, float("inf"))
            for _ in range(args.repeat):
                for name, (run, _) in decoders.items():
                    best[name] = min(best[name], run()[0])
            for _, close in decoders.values():
                close()
            rows.append(
                {"batch": B, **{f"{n}_ms": best[n] * 1e3 for n in BACKENDS}, "speedup": best["torch"] / best["cpu"]}
            )
    return rows


def parse_shape(shape: str) -> tuple[int, int, int]:
    """'BxN' or 'BxN+P' -> (B, N, P)"""
    try:
        batch, rest = shape.split("x")
        new, _, prefix = rest.partition("+")
        B, n, p = int(batch), int(new), int(prefix or 0)
    except ValueError:
        raise ValueError(f"--shapes: {shape!r} is not BxN or BxN+P") from None
    if B < 1 or n < 2 or p < 0:
        raise ValueError(f"--shapes: {shape!r} needs B >= 1 requests of N >= 2 new tokens")
    return B, n, p


def compare(backends: dict, meta, q, k, v, repeat: int) -> dict:
    """best whole-step seconds per backend (interleaved, after a warm-up round) and the outputs' max diff"""
    best = dict.fromkeys(BACKENDS, float("inf"))
    for _ in range(repeat + 1):
        for name, backend in backends.items():
            best[name] = min(best[name], step_seconds(backend, meta, q, k, v))
    outs = {}
    for name, backend in backends.items():
        backend.plan(meta)
        outs[name] = backend.forward(q, k, v, 0)
    return {"best": best, "max_abs_diff": float((outs["torch"] - outs["cpu"]).abs().max())}


def extend_main(args: argparse.Namespace, backends: dict, started: report.Started) -> None:
    rng = np.random.default_rng(0)
    rows = []
    for shape in args.shapes.split(","):
        B, n, prefix = parse_shape(shape)
        counts = np.full(B, -(-(prefix + n) // PAGE))
        if counts.sum() > args.pool_pages:
            raise SystemExit(f"--shapes {shape} needs {counts.sum()} pages; raise --pool-pages")
        pages = np.split(rng.permutation(args.pool_pages)[: counts.sum()].astype(np.int32), np.cumsum(counts)[:-1])
        seqs = [SeqInput(b, np.zeros(n, np.int32), prefix, pages[b], True) for b in range(B)]
        meta = build_forward_batch(seqs, PAGE, context_length=8192, device=torch.device("cpu")).meta
        T = meta.num_tokens
        q = torch.randn(T, HQ + 2 * HKV, D)[:, :HQ]  # a slice, as of the model's fused qkv
        k, v = torch.randn(T, HKV, D), torch.randn(T, HKV, D)
        r = compare(backends, meta, q, k, v, args.repeat)
        rows.append(
            {
                "shape": shape,
                "requests": B,
                "new_tokens": n,
                "cached_prefix": prefix,
                **{f"{name}_ms_per_layer": r["best"][name] / LAYERS * 1e3 for name in BACKENDS},
                "speedup": r["best"]["torch"] / r["best"]["cpu"],
                "max_abs_diff": r["max_abs_diff"],
            }
        )
    result = {"config": {**config(args), "mode": "extend", "shapes": args.shapes}, "steps": rows}
    md = "\n".join(
        [
            f"threads={args.threads} load_avg={os.getloadavg()[0]:.1f} kv_cache_dtype={args.kv_cache_dtype}; "
            f"ms per layer of a prefill step (plan + {LAYERS} layers, / {LAYERS}), best of {args.repeat}",
            "",
            report.table(
                ("shape", "torch ms", "cpu ms", "x torch", "max abs diff"),
                [
                    (
                        r["shape"],
                        f"{r['torch_ms_per_layer']:.2f}",
                        f"{r['cpu_ms_per_layer']:.2f}",
                        f"{r['speedup']:.2f}",
                        f"{r['max_abs_diff']:.1e}",
                    )
                    for r in rows
                ],
            ),
        ]
    )
    print(md)
    print(
        "wrote " + " and ".join(map(str, report.write_results("attention_extend", result, md, started, out=args.out)))
    )


def config(args: argparse.Namespace) -> dict:
    return {
        "threads": args.threads,
        "layers": LAYERS,
        "q_heads": HQ,
        "kv_heads": HKV,
        "head_dim": D,
        "page_size": PAGE,
        "repeat": args.repeat,
        "kv_cache_dtype": args.kv_cache_dtype,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument(
        "--kv-len",
        type=int,
        nargs=2,
        default=(111, 240),
        metavar=("MIN", "MAX"),
        help="each request's cached tokens, uniform (the serving benchmark's ~110-token prompts + 64)",
    )
    ap.add_argument("--pool-pages", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quantization", default="none", choices=["none", *ACTIVATIONS], help="for the whole-step runs")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request in the whole-step runs")
    ap.add_argument("--mode", default="decode", choices=["decode", "extend"])
    ap.add_argument(
        "--shapes",
        default="24x85,24x85+30,1x512",
        help="extend mode: BxN (B requests of N new tokens) or BxN+P (after a P-token cached prefix)",
    )
    report.add_arguments(ap, None)  # decode: attention.json, extend: attention_extend.json
    args = ap.parse_args()
    started = report.start(args)
    try:
        [parse_shape(shape) for shape in args.shapes.split(",")]
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype, torch.float32)  # auto: the model's fp32
    cache = KVCache(LAYERS, args.pool_pages, PAGE, HKV, D, kv_dtype, torch.device("cpu"))
    cache.buffer.normal_()  # every slot finite and resident
    backends = {name: create_backend(name, cache, HQ) for name in BACKENDS}
    if args.mode == "extend":
        extend_main(args, backends, started)
        return
    rng = np.random.default_rng(0)
    rows = []
    for layout in ("contiguous", "scattered"):
        for B in (int(b) for b in args.batches.split(",")):
            kv_lens = rng.integers(args.kv_len[0], args.kv_len[1] + 1, B)
            counts = -(-kv_lens // PAGE)
            order = np.arange(args.pool_pages) if layout == "contiguous" else rng.permutation(args.pool_pages)
            pages = np.split(order[: counts.sum()].astype(np.int32), np.cumsum(counts)[:-1])
            seqs = [SeqInput(b, np.zeros(1, np.int32), int(kv_lens[b]) - 1, pages[b], True) for b in range(B)]
            meta = build_forward_batch(seqs, PAGE, context_length=4096, device=torch.device("cpu")).meta
            q, k, v = torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D)
            r = compare(backends, meta, q, k, v, args.repeat)
            rows.append(
                {
                    "pages": layout,
                    "batch": B,
                    "kv_tokens": int(kv_lens.sum()),
                    **{f"{n}_ms": r["best"][n] * 1e3 for n in BACKENDS},
                    "speedup": r["best"]["torch"] / r["best"]["cpu"],
                    "max_abs_diff": r["max_abs_diff"],
                }
            )
    del cache, backends
    step_rows = whole_steps(args, [int(b) for b in args.batches.split(",")])
    result = {
        "config": {
            **config(args),
            "kv_len": list(args.kv_len),
            "quantization": args.quantization,
            "context": args.context,
        },
        "steps": rows,
        "model_steps": step_rows,
    }
    md = "\n".join(
        [
            f"threads={args.threads} load_avg={os.getloadavg()[0]:.1f} kv_cache_dtype={args.kv_cache_dtype}; "
            f"ms per decode step, all {LAYERS} layers",
            "",
            report.table(
                ("pages", "batch", "kv tokens", "torch ms", "cpu ms", "x torch", "max abs diff"),
                [
                    (
                        r["pages"],
                        r["batch"],
                        r["kv_tokens"],
                        f"{r['torch_ms']:.1f}",
                        f"{r['cpu_ms']:.1f}",
                        f"{r['speedup']:.2f}",
                        f"{r['max_abs_diff']:.1e}",
                    )
                    for r in rows
                ],
            ),
            "",
            f"whole decode steps of the model (quantization {args.quantization}), ms",
            "",
            report.table(
                ("batch", "torch ms", "cpu ms", "x torch"),
                [(r["batch"], f"{r['torch_ms']:.1f}", f"{r['cpu_ms']:.1f}", f"{r['speedup']:.2f}") for r in step_rows],
            ),
        ]
    )
    print(md)
    print("wrote " + " and ".join(map(str, report.write_results("attention", result, md, started, out=args.out))))


if __name__ == "__main__":
    main()
