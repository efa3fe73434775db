"""Forward benchmark: this executor vs transformers' own model with its KV cache, same
weights (the embedded SmolLM2 unless --model-path), same process, same run.

Measures decode step time and tokens/s at several batch sizes (each request holding
--context tokens of prompt), prefill tokens/s for one --prefill-token prompt, and the start
time of the ModelRunner; prints a table and writes perf/results/forward.json and forward.md
(perf/report.py). With several
--quantization modes and/or --kv-cache-dtype values, one ModelRunner per pair in this process,
all interleaved with transformers (which stays fp32) in each timed round.

    python -m perf.forward_bench [--threads N] [--batches 1,8,32] [--cold-start]
                                 [--quantization none,gguf,gguf-q8] [--kv-cache-dtype auto,float16]
                                 [--products 1,8,32,128,512]

--products also times all of the model's products alone (every layer's qkv, o, gate_up and
down, then lm_head, through gpu.models.llama.linear) at those token counts, per mode: where
QUANTIZED_MAX_TOKENS (gpu/quant/blocks.py) comes from.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch

from gpu.model_runner import KV_CACHE_DTYPES, ModelRunner, ModelRunnerConfig, SeqInput
from gpu.models.llama import linear
from gpu.quant.loader import ACTIVATIONS
from perf import report
from protocol.sampling_params import SamplingParams

MODES = ("none", *ACTIVATIONS)  # --quantization values; none: the fp32 weights
KV_DTYPES = ("auto", *KV_CACHE_DTYPES)  # --kv-cache-dtype values; auto: the model's dtype


def timed(fn) -> np.ndarray:
    """[wall seconds, CPU seconds of this process]; on a shared machine the CPU time shows the
    work done, the wall time also the waits for a core."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return np.array([time.perf_counter() - t, time.process_time() - c])


def ours_decoder(runner: ModelRunner, prompts: np.ndarray, steps: int, repeat: int):
    """Prefills a batch of len(prompts) requests; returns (run, close): run() times `steps`
    decode steps and returns [wall, cpu] seconds per step."""
    B, ctx = prompts.shape
    pages = [runner.pool.alloc(runner.pool.pages_for(ctx + 2 + steps * repeat)) for _ in range(B)]
    for row in range(B):
        runner.set_request(row, SamplingParams(temperature=0.0), prompts[row], np.zeros(0, np.int32))
    out = runner.step([SeqInput(b, prompts[b], 0, pages[b], True) for b in range(B)])
    pos = ctx

    def decode(n: int) -> None:
        nonlocal out, pos
        for _ in range(n):
            out = runner.step([SeqInput(b, out.tokens[b : b + 1], pos, pages[b], True) for b in range(B)])
            pos += 1

    def close() -> None:
        for p in pages:
            runner.pool.free(p)

    decode(2)  # warm-up
    return (lambda: timed(lambda: decode(steps)) / steps), close


def hf_decode(model, prompts: np.ndarray, steps: int) -> np.ndarray:
    """[wall, cpu] seconds per step of the model's own forward with its DynamicCache, greedy."""
    out = model(torch.from_numpy(prompts.astype(np.int64)), use_cache=True, logits_to_keep=1)
    cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    def decode(n: int) -> None:
        nonlocal cache, tok
        for _ in range(n):
            out = model(tok, past_key_values=cache, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

    decode(2)  # warm-up
    return timed(lambda: decode(steps)) / steps


def hf_generate(model, prompts: np.ndarray, new_tokens: int, pad_id: int) -> np.ndarray:
    """Seconds for generate() to produce new_tokens per request; a decode step's cost is the
    difference between two lengths, divided by their difference."""
    ids = torch.from_numpy(prompts.astype(np.int64))
    return timed(
        lambda: model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    )


def products_seconds(runner: ModelRunner, tokens: int, repeat: int) -> float:
    """Best of `repeat` passes of every projection of the model through linear(), as forward()
    calls it, on random [tokens, K] inputs."""
    model = runner.model
    weights = [
        (w, w_t)
        for i in range(runner.model_config.num_layers)
        for w, w_t in (
            (model.qkv[i], None),
            (model.o[i], None),
            (model.gate_up[i], model.gate_up_t[i]),
            (model.down[i], None),
        )
    ] + [(model.lm_head, model.lm_head_t)]
    xs = {w.shape[1]: torch.randn(tokens, w.shape[1]) for w, _ in weights}

    def one_pass() -> None:
        for w, w_t in weights:
            linear(xs[w.shape[1]], w, w_t=w_t)

    one_pass()  # warm-up
    return min(timed(one_pass)[0] for _ in range(repeat))


def cold_start_seconds() -> float:
    """First start on a fresh cache: GGUF conversion + load (the cached start is measured apart)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, RINGSERVE_CACHE_DIR=cache)
        old = os.environ.copy()
        os.environ.update(env)
        try:
            t = time.perf_counter()
            ModelRunner(ModelRunnerConfig(max_total_tokens=1024, max_running_requests=1))
            return time.perf_counter() - t
        finally:
            os.environ.clear()
            os.environ.update(old)


def choices(allowed: tuple[str, ...]):
    """An argparse type: a comma-separated list of distinct values from `allowed`."""

    def parse(value: str) -> list[str]:
        out = value.split(",")
        if any(v not in allowed for v in out) or len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"a comma-separated list of distinct {', '.join(allowed)}, not {value!r}")
        return out

    return parse


def label(mode: str, kv: str) -> str:
    """A runner's name in the results: its --quantization mode, and its KV cache dtype unless auto."""
    return mode if kv == "auto" else f"{mode} kv {kv}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request before decoding")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many timed runs")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-generate", action="store_true", help="skip the transformers generate() baseline")
    ap.add_argument("--cold-start", action="store_true", help="also time a start with GGUF conversion")
    ap.add_argument(
        "--quantization",
        type=choices(MODES),
        default=["none"],
        help=f"executor weights, comma-separated, each its own ModelRunner: {', '.join(MODES)} "
        "(gguf: the GGUF's own Q4_1/Q8_0 blocks; gguf-q8: the same with int8 activations; "
        "transformers stays fp32)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        type=choices(KV_DTYPES),
        default=["auto"],
        help="KV cache element types, comma-separated, each with every --quantization mode",
    )
    ap.add_argument("--products", default="", help="token counts at which to time the products alone")
    report.add_arguments(ap, "forward")
    args = ap.parse_args()
    started = report.start(args)
    torch.set_num_threads(args.threads)  # this process is the benchmark's own
    batches = [int(b) for b in args.batches.split(",")]
    product_tokens = [int(t) for t in args.products.split(",") if t]

    runners, start_s = {}, {}
    for mode in args.quantization:
        for kv in args.kv_cache_dtype:
            t = time.perf_counter()
            runners[label(mode, kv)] = ModelRunner(
                ModelRunnerConfig(
                    model_path=args.model_path,
                    max_running_requests=max(batches),
                    quantization=mode,
                    kv_cache_dtype=kv,
                    max_total_tokens=max(batches) * (args.context + 2 + args.steps * args.repeat + 64)
                    + args.prefill
                    + 64,
                )
            )
            start_s[label(mode, kv)] = time.perf_counter() - t
    first = next(iter(runners.values()))
    from gpu.models.reference import reference_model

    hf = reference_model(args.model_path)
    pad_id = first.model_config.eos_token_ids[0]
    rng = np.random.default_rng(0)
    V = first.model_config.vocab_size

    rows = []
    with torch.inference_mode():
        for B in batches:
            prompts = rng.integers(100, V, size=(B, args.context)).astype(np.int32)
            decoders = {name: ours_decoder(r, prompts, args.steps, args.repeat) for name, r in runners.items()}
            if not args.no_generate:
                hf_generate(hf, prompts, 2, pad_id)  # warm-up
            # all interleaved, best of `repeat` each: a shared machine's load hits them alike
            ours, theirs, gen_long, gen_short = {m: [] for m in runners}, [], [], []
            for _ in range(args.repeat):
                for name, (run, _) in decoders.items():
                    ours[name].append(run())
                theirs.append(hf_decode(hf, prompts, args.steps))
                if not args.no_generate:
                    gen_long.append(hf_generate(hf, prompts, 1 + args.steps, pad_id))
                    gen_short.append(hf_generate(hf, prompts, 1, pad_id))
            for _, close in decoders.values():
                close()
            theirs = np.min(theirs, axis=0)  # [wall, cpu] per step
            gen = None if args.no_generate else (np.min(gen_long, axis=0) - np.min(gen_short, axis=0)) / args.steps
            for name in runners:
                o = np.min(ours[name], axis=0)
                c = runners[name].config
                rows.append(
                    {
                        "batch": B,
                        "runner": name,
                        "quantization": c.quantization,
                        "kv_cache_dtype": c.kv_cache_dtype,
                        "ours_ms": o[0] * 1e3,
                        "ours_cpu_ms": o[1] * 1e3,
                        "hf_ms": theirs[0] * 1e3,
                        "hf_cpu_ms": theirs[1] * 1e3,
                        "hf_generate_ms": None if gen is None else gen[0] * 1e3,
                        "hf_generate_cpu_ms": None if gen is None else gen[1] * 1e3,
                        "ours_tok_s": B / o[0],
                        "hf_tok_s": B / theirs[0],
                        "hf_generate_tok_s": None if gen is None else B / gen[0],
                        "ratio_vs_hf": theirs[0] / o[0],
                        "cpu_ratio_vs_hf": theirs[1] / o[1],
                        "ratio_vs_generate": None if gen is None else gen[0] / o[0],
                        "cpu_ratio_vs_generate": None if gen is None else gen[1] / o[1],
                    }
                )
        prompt = rng.integers(100, V, size=args.prefill).astype(np.int32)
        ids = torch.from_numpy(prompt.astype(np.int64))[None]
        ours_p, hf_p = {m: [] for m in runners}, []
        pages = {m: r.pool.alloc(r.pool.pages_for(args.prefill)) for m, r in runners.items()}
        for r in runners.values():
            r.set_request(0, SamplingParams(temperature=0.0), prompt, np.zeros(0, np.int32))
        for _ in range(args.repeat + 1):  # the first of each is a warm-up
            for name, r in runners.items():
                ours_p[name].append(timed(lambda: r.step([SeqInput(0, prompt, 0, pages[name], True)])))
            hf_p.append(timed(lambda: hf(ids, use_cache=True, logits_to_keep=1)))
        for name, r in runners.items():
            r.pool.free(pages[name])
        hf_p = np.min(hf_p[1:], axis=0)
        products = [
            {"tokens": T, **{f"{name}_ms": products_seconds(r, T, args.repeat) * 1e3 for name, r in runners.items()}}
            for T in product_tokens
        ]
    prefill = []
    for name in runners:
        o = np.min(ours_p[name][1:], axis=0)
        prefill.append(
            {
                "runner": name,
                "tokens": args.prefill,
                "ours_tok_s": args.prefill / o[0],
                "hf_tok_s": args.prefill / hf_p[0],
                "ratio": hf_p[0] / o[0],
                "cpu_ratio": hf_p[1] / o[1],
            }
        )
    result = {
        "config": {
            "threads": args.threads,
            "context": args.context,
            "steps": args.steps,
            "repeat": args.repeat,
            "dtype": "float32",
            "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "attention_backend": first.attention_backend,
            "device": str(first.device),
        },
        "start_seconds_cached": start_s,
        "start_seconds_cold": cold_start_seconds() if args.cold_start else None,
        "decode": rows,
        "prefill": prefill,
        "products": products,
    }
    print(
        f"threads={args.threads} load_avg={os.getloadavg()[0]:.1f} context={args.context} "
        f"steps={args.steps} (best of {args.repeat})"
    )
    fmt = report.fmt
    print(
        f"{'batch':>5} {'runner':>22} {'ours ms/step':>12} {'ours tok/s':>10} {'hf tok/s':>9} "
        f"{'generate tok/s':>14} {'x hf':>6} {'x generate':>10} {'x hf (cpu)':>10} {'x generate (cpu)':>16}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['runner']:>22} {r['ours_ms']:>12.1f} {r['ours_tok_s']:>10.1f} "
            f"{r['hf_tok_s']:>9.1f} {fmt(r['hf_generate_tok_s'], '.1f'):>14} {r['ratio_vs_hf']:>6.2f} "
            f"{fmt(r['ratio_vs_generate'], '.2f'):>10} {r['cpu_ratio_vs_hf']:>10.2f} "
            f"{fmt(r['cpu_ratio_vs_generate'], '.2f'):>16}"
        )
    for p in prefill:
        print(
            f"prefill {args.prefill} tokens ({p['runner']}): ours {p['ours_tok_s']:.0f} tok/s, "
            f"transformers {p['hf_tok_s']:.0f} tok/s, x{p['ratio']:.2f} (cpu time x{p['cpu_ratio']:.2f})"
        )
    if products:
        print("all products of a forward, ms: " + " | ".join(f"{name}" for name in runners))
        for p in products:
            print(f"{p['tokens']:>5} tokens: " + " | ".join(f"{p[f'{name}_ms']:.1f}" for name in runners))
    cold = result["start_seconds_cold"]
    print(
        "ModelRunner start, cached: "
        + ", ".join(f"{m} {s:.1f} s" for m, s in start_s.items())
        + (f"; {cold:.1f} s with GGUF conversion" if cold else "")
    )
    print(
        "wrote "
        + " and ".join(
            map(str, report.write_results("forward", result, markdown(result, runners), started, out=args.out))
        )
    )


def markdown(result: dict, runners: dict) -> str:
    c, fmt = result["config"], report.fmt
    lines = [
        f"{c['threads']} torch threads, context {c['context']}, {c['steps']} decode steps, best of {c['repeat']}; "
        f"x: their time / ours (wall, and CPU time of this process).",
        "",
        report.table(
            (
                "batch",
                "runner",
                "ours ms/step",
                "ours tok/s",
                "hf tok/s",
                "generate tok/s",
                "x hf",
                "x generate",
                "x hf (cpu)",
                "x generate (cpu)",
            ),
            [
                (
                    r["batch"],
                    r["runner"],
                    f"{r['ours_ms']:.1f}",
                    f"{r['ours_tok_s']:.1f}",
                    f"{r['hf_tok_s']:.1f}",
                    fmt(r["hf_generate_tok_s"]),
                    f"{r['ratio_vs_hf']:.2f}",
                    fmt(r["ratio_vs_generate"], ".2f"),
                    f"{r['cpu_ratio_vs_hf']:.2f}",
                    fmt(r["cpu_ratio_vs_generate"], ".2f"),
                )
                for r in result["decode"]
            ],
        ),
        "",
        report.table(
            ("prefill runner", "tokens", "ours tok/s", "transformers tok/s", "x", "x (cpu)"),
            [
                (
                    p["runner"],
                    p["tokens"],
                    f"{p['ours_tok_s']:.0f}",
                    f"{p['hf_tok_s']:.0f}",
                    f"{p['ratio']:.2f}",
                    f"{p['cpu_ratio']:.2f}",
                )
                for p in result["prefill"]
            ],
        ),
    ]
    if result["products"]:
        lines += [
            "",
            "All products of a forward, ms:",
            "",
            report.table(
                ("tokens", *runners),
                [(p["tokens"], *(f"{p[f'{name}_ms']:.1f}" for name in runners)) for p in result["products"]],
            ),
        ]
    cold = result["start_seconds_cold"]
    lines += [
        "",
        "ModelRunner start, cached: "
        + ", ".join(f"{m} {s:.1f} s" for m, s in result["start_seconds_cached"].items())
        + (f"; {cold:.1f} s with GGUF conversion" if cold else ""),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
