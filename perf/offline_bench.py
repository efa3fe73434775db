"""Offline throughput: the Engine (continuous batching, paged KV, radix cache) versus
transformers' batched `generate` (left-padded), same model, same prompts, same run.

    python -m perf.offline_bench [--num-prompts 128] [--input-len 16 128] [--output-len 16 128]

Prompts are random token ids with random input and output lengths (fixed seed); every
request generates exactly its output length (ignore_eos / min_new_tokens), greedy.
transformers runs the prompts in batches of --hf-batch-size, each generating the longest
output length of its batch; both sides are credited with the requested tokens only.
Also measures the scheduler core's own CPU per token with the null model (--null-streams).
Prints a table; writes perf/results/offline.json and offline.md (perf/report.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from gpu.model_runner import KV_CACHE_DTYPES
from gpu.quant.loader import ACTIVATIONS
from perf import report


def make_prompts(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1] + 1, size=n)
    out_lens = rng.integers(output_len[0], output_len[1] + 1, size=n)
    prompts = [rng.integers(100, vocab - 100, size=int(k)).tolist() for k in in_lens]
    return prompts, out_lens.tolist()


def run_engine(args, prompts, out_lens) -> dict:
    from protocol.sampling_params import SamplingParams
    from runtime.offline import OfflineEngine

    engine = OfflineEngine(
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_total_tokens=args.max_total_tokens,
        attention_backend=args.attention_backend,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm-up
    engine.flush_cache()
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in out_lens]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == out_lens
    stats = engine.scheduler.stats
    return {
        "elapsed_s": elapsed,
        "steps": stats.steps,
        "retractions": stats.retractions,
        "attention_backend": engine.runner.attention_backend,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
    }


def run_transformers(args, prompts, out_lens) -> dict:
    from gpu.models.reference import reference_model

    model = reference_model()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def generate(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            return model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )

    generate([prompts[0]], 4)  # warm-up
    bs = args.hf_batch_size
    start = time.perf_counter()
    for i in range(0, len(prompts), bs):
        generate(prompts[i : i + bs], max(out_lens[i : i + bs]))
    return {"elapsed_s": time.perf_counter() - start, "batch_size": bs}


def run_null_scheduler(streams: int, steps: int = 300) -> dict:
    """The scheduler core's own CPU per token: `streams` requests decoding on the null model
    (instant tokens), what the server's scheduler process spends per step besides the forward."""
    from gpu.model_runner import ModelRunnerConfig
    from gpu.null_model import NullModelRunner
    from protocol.sampling_params import SamplingParams
    from runtime.scheduler.config import SchedulerConfig
    from runtime.scheduler.core import Scheduler

    runner = NullModelRunner(ModelRunnerConfig(max_total_tokens=streams * 512, max_running_requests=streams))
    sched = Scheduler(
        runner,
        SchedulerConfig(
            context_length=runner.model_config.context_length,
            max_running_requests=streams,
            speculative_algorithm="none",
        ),
    )
    for i in range(streams):
        sched.add_request(0, i, 1, np.arange(100, 200) + i, SamplingParams(max_new_tokens=steps + 50, ignore_eos=True))
    for _ in range(10):  # admission and prefill
        sched.step()
    tokens, cpu = 0, time.process_time()
    for _ in range(steps):
        tokens += sched.step().num_sampled
    cpu = time.process_time() - cpu
    return {
        "streams": streams,
        "steps": steps,
        "cpu_us_per_step": cpu / steps * 1e6,
        "cpu_us_per_token": cpu / tokens * 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-running-requests", type=int, default=128)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument(
        "--quantization", default="none", choices=["none", *ACTIVATIONS], help="the Engine's (transformers stays fp32)"
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES], help="the Engine's KV cache"
    )
    ap.add_argument("--hf-batch-size", type=int, default=128)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--null-streams",
        type=int,
        default=256,
        help="also measure the scheduler core's CPU per token at this many null-model streams (0: skip)",
    )
    report.add_arguments(ap, "offline")
    args = ap.parse_args()
    started = report.start(args)

    from gpu.models.model_config import ModelConfig
    from gpu.models.model_files import resolve_model_dir

    vocab = ModelConfig.from_dir(resolve_model_dir(None)).vocab_size
    prompts, out_lens = make_prompts(args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.seed)
    input_tokens, output_tokens = sum(map(len, prompts)), sum(out_lens)
    runs = {"ringserve Engine": run_engine(args, prompts, out_lens)}
    if not args.skip_transformers:
        runs["transformers generate"] = run_transformers(args, prompts, out_lens)
    for r in runs.values():
        r["output_tok_s"] = output_tokens / r["elapsed_s"]
        r["total_tok_s"] = (input_tokens + output_tokens) / r["elapsed_s"]
        r["requests_s"] = len(prompts) / r["elapsed_s"]
    result = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "torch_threads": torch.get_num_threads(),
        },
        "runs": runs,
    }
    if args.null_streams:
        result["null_model_scheduler"] = run_null_scheduler(args.null_streams)
    if "transformers generate" in runs:
        result["output_tok_s_ratio"] = (
            runs["ringserve Engine"]["output_tok_s"] / runs["transformers generate"]["output_tok_s"]
        )
    workload = (
        f"{len(prompts)} prompts, {input_tokens} input tokens, {output_tokens} output tokens "
        f"(input {args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-{args.output_len[1]}, "
        f"seed {args.seed}), torch threads {torch.get_num_threads()}"
    )
    print(workload)
    print(f"{'':24} {'time s':>8} {'req/s':>8} {'output tok/s':>13} {'total tok/s':>12}")
    for name, r in runs.items():
        print(
            f"{name:24} {r['elapsed_s']:8.1f} {r['requests_s']:8.2f} {r['output_tok_s']:13.1f} {r['total_tok_s']:12.1f}"
        )
    if "output_tok_s_ratio" in result:
        print(f"output tokens/s ratio (Engine / transformers): {result['output_tok_s_ratio']:.2f}x")
    if "null_model_scheduler" in result:
        n = result["null_model_scheduler"]
        print(
            f"scheduler core on the null model, {n['streams']} streams: {n['cpu_us_per_step']:.0f} us CPU per step, "
            f"{n['cpu_us_per_token']:.2f} us per token"
        )
    print(
        "wrote "
        + " and ".join(
            map(str, report.write_results("offline", result, markdown(result, workload), started, out=args.out))
        )
    )


def markdown(result: dict, workload: str) -> str:
    lines = [
        workload + ", greedy, every request generating exactly its output length.",
        "",
        report.table(
            ("", "time s", "req/s", "output tok/s", "total tok/s"),
            [
                (
                    name,
                    f"{r['elapsed_s']:.1f}",
                    f"{r['requests_s']:.2f}",
                    f"{r['output_tok_s']:.1f}",
                    f"{r['total_tok_s']:.1f}",
                )
                for name, r in result["runs"].items()
            ],
        ),
    ]
    if "output_tok_s_ratio" in result:
        lines += ["", f"Output tokens/s ratio (Engine / transformers): {result['output_tok_s_ratio']:.2f}x"]
    if "null_model_scheduler" in result:
        n = result["null_model_scheduler"]
        lines += [
            "",
            f"Scheduler core on the null model, {n['streams']} streams: {n['cpu_us_per_step']:.0f} µs CPU "
            f"per step, {n['cpu_us_per_token']:.2f} µs per token.",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
