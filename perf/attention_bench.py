"""Attention benchmark: one decode step's attention over all layers (SmolLM2's shapes: 30
layers, 9 query heads, 3 kv heads, head_dim 64, pages of 16), for the cpu backend (the C
kernel reading pages in place) against the torch backend (page gather + masked SDPA), same
run, interleaved, best of --repeat. Requests' pages either follow one another in the pool or
are scattered through it (a long-running server's pool); kv lengths are ragged, as in a
serving batch. The two backends' outputs are compared too.

Then whole decode steps of the real model (the embedded SmolLM2, 128-token prompts), one
ModelRunner per backend in this process, interleaved, best of --repeat (--quantization gguf or
gguf-q8: both on the GGUF's blocks). --kv-cache-dtype float16 / bfloat16: the KV cache in that
type, for both parts.

    python perf/attention_bench.py [--threads N] [--batches 1,8,32] [--quantization gguf|gguf-q8]
                                   [--kv-cache-dtype auto|float16|bfloat16]
                                   # writes perf/results/attention.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forward_bench import ours_decoder  # noqa: E402  (perf/, beside this file)
from gpu.attention import create_backend  # noqa: E402
from gpu.forward_batch import SeqInput, build_forward_batch  # noqa: E402
from gpu.kv_cache import KVCache  # noqa: E402
from gpu.model_runner import KV_CACHE_DTYPES, ModelRunner, ModelRunnerConfig  # noqa: E402
from gpu.quant import ACTIVATIONS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "attention.json"
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
    runners = {name: ModelRunner(ModelRunnerConfig(
        attention_backend=name, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        max_running_requests=max(batches),
        max_total_tokens=max(batches) * (args.context + 2 + steps * (args.repeat + 1) + 32))) for name in BACKENDS}
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
            rows.append({"batch": B, **{f"{n}_ms": best[n] * 1e3 for n in BACKENDS},
                         "speedup": best["torch"] / best["cpu"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--kv-len", type=int, nargs=2, default=(111, 240), metavar=("MIN", "MAX"),
                    help="each request's cached tokens, uniform (the serving benchmark's ~110-token prompts + 64)")
    ap.add_argument("--pool-pages", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--quantization", default=None, choices=list(ACTIVATIONS), help="for the whole-step runs")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request in the whole-step runs")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kv_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype, torch.float32)  # auto: the model's fp32
    cache = KVCache(LAYERS, args.pool_pages, PAGE, HKV, D, kv_dtype, torch.device("cpu"))
    cache.buffer.normal_()  # every slot finite and resident
    backends = {name: create_backend(name, cache, HQ) for name in BACKENDS}
    rng = np.random.default_rng(0)
    rows = []
    for layout in ("contiguous", "scattered"):
        for B in (int(b) for b in args.batches.split(",")):
            kv_lens = rng.integers(args.kv_len[0], args.kv_len[1] + 1, B)
            counts = -(-kv_lens // PAGE)
            order = np.arange(args.pool_pages) if layout == "contiguous" else rng.permutation(args.pool_pages)
            pages = np.split(order[:counts.sum()].astype(np.int32), np.cumsum(counts)[:-1])
            seqs = [SeqInput(b, np.zeros(1, np.int32), int(kv_lens[b]) - 1, pages[b], True) for b in range(B)]
            meta = build_forward_batch(seqs, PAGE, context_length=4096, device=torch.device("cpu")).meta
            q, k, v = torch.randn(B, HQ, D), torch.randn(B, HKV, D), torch.randn(B, HKV, D)
            best = dict.fromkeys(BACKENDS, float("inf"))
            for _ in range(args.repeat + 1):  # the first round warms up
                for name, backend in backends.items():
                    best[name] = min(best[name], step_seconds(backend, meta, q, k, v))
            outs = {}
            for name, backend in backends.items():
                backend.plan(meta)
                outs[name] = backend.forward(q, k, v, 0)
            rows.append({"pages": layout, "batch": B, "kv_tokens": int(kv_lens.sum()),
                         **{f"{n}_ms": best[n] * 1e3 for n in BACKENDS},
                         "speedup": best["torch"] / best["cpu"],
                         "max_abs_diff": float((outs["torch"] - outs["cpu"]).abs().max())})
    del cache, backends
    step_rows = whole_steps(args, [int(b) for b in args.batches.split(",")])
    result = {"machine": {"cores": os.cpu_count(), "threads": args.threads, "load_avg": os.getloadavg()},
              "config": {"layers": LAYERS, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "page_size": PAGE,
                         "kv_len": list(args.kv_len), "repeat": args.repeat, "quantization": args.quantization,
                         "kv_cache_dtype": args.kv_cache_dtype,
                         "context": args.context},
              "steps": rows, "model_steps": step_rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"threads={args.threads} load_avg={os.getloadavg()[0]:.1f} kv_cache_dtype={args.kv_cache_dtype}; "
          f"ms per decode step, all {LAYERS} layers")
    print("| pages | batch | kv tokens | torch ms | cpu ms | x torch | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pages']} | {r['batch']} | {r['kv_tokens']} | {r['torch_ms']:.1f} | {r['cpu_ms']:.1f} | "
              f"{r['speedup']:.2f} | {r['max_abs_diff']:.1e} |")
    print(f"whole decode steps of the model (quantization {args.quantization}), ms")
    print("| batch | torch ms | cpu ms | x torch |")
    print("|---|---|---|---|")
    for r in step_rows:
        print(f"| {r['batch']} | {r['torch_ms']:.1f} | {r['cpu_ms']:.1f} | {r['speedup']:.2f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
