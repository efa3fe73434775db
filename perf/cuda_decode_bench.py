"""Decode step time of the ModelRunner on CUDA per attention backend: SmolLM2's shape (30 layers,
hidden 576, 9 / 3 heads of 64, vocab 49152) with random weights in bf16 (the time does not depend
on the values), batch 1 and 32, each request holding --context tokens. A step is runner.step()
as the scheduler calls it: batch built on the host, forward, greedy sampling, tokens back on the
host; no CUDA graphs. Prints a table; writes perf/results/cuda_decode.json and cuda_decode.md
(perf/report.py). Without a CUDA device it says so and exits with status 1.

    python -m perf.cuda_decode_bench [--backends torch,triton,flashinfer] [--batches 1,32]
                                     [--context 512] [--steps 50]
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpu.model_runner import ModelRunner, ModelRunnerConfig, SeqInput
from perf import report
from protocol.sampling_params import SamplingParams

SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=100000.0),
)
PAGE = 16


def save_model(path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2), dtype=torch.bfloat16).save_pretrained(path)


def decode_step_ms(runner: ModelRunner, batch: int, context: int, steps: int) -> np.ndarray:
    """Prefills `batch` requests of `context` tokens, then times `steps` decode steps; [steps] ms."""
    rng = np.random.default_rng(0)
    pages = [runner.pool.alloc(runner.pool.pages_for(context + steps + 1)) for _ in range(batch)]
    prompts = rng.integers(3, SMOLLM2["vocab_size"], (batch, context)).astype(np.int32)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=steps + 1)
    for row in range(batch):
        runner.set_request(row, greedy, prompts[row], np.zeros(0, np.int32))
    last = runner.step([SeqInput(b, prompts[b], 0, pages[b], True) for b in range(batch)]).tokens
    times = []
    for i in range(steps):
        t = time.perf_counter()
        last = runner.step([SeqInput(b, last[b : b + 1], context + i, pages[b], True) for b in range(batch)]).tokens
        times.append((time.perf_counter() - t) * 1e3)  # step() returns host tokens: it waited for the GPU
    for row, p in enumerate(pages):
        runner.clear_request(row)
        runner.pool.free(p)
    return np.array(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="torch,triton,flashinfer")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    report.add_arguments(ap, "cuda_decode")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_decode_bench: needs a CUDA device (torch.cuda.is_available() is False); nothing written")
    started = report.start(args)
    batches = [int(b) for b in args.batches.split(",")]
    backends = [b for b in args.backends.split(",") if b != "flashinfer" or importlib.util.find_spec("flashinfer")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp))
        for backend in backends:
            runner = ModelRunner(
                ModelRunnerConfig(
                    model_path=tmp,
                    device="cuda",
                    dtype="bfloat16",
                    attention_backend=backend,
                    page_size=PAGE,
                    max_total_tokens=max(batches) * (args.context + args.steps + 2 * PAGE),
                    max_running_requests=max(batches),
                )
            )
            for batch in batches:
                decode_step_ms(runner, batch, args.context, 5)  # compiles / JIT-loads this shape's kernels
                ms = decode_step_ms(runner, batch, args.context, args.steps)
                rows.append(
                    dict(
                        backend=backend,
                        batch=batch,
                        context=args.context,
                        steps=args.steps,
                        median_ms=float(np.median(ms)),
                        p10_ms=float(np.percentile(ms, 10)),
                        p90_ms=float(np.percentile(ms, 90)),
                        tok_s=float(batch * 1e3 / np.median(ms)),
                    )
                )
            del runner
            torch.cuda.empty_cache()
    result = dict(device=torch.cuda.get_device_name(), dtype="bfloat16", rows=rows)
    title = f"{result['device']}, torch {torch.__version__}, bf16, context {args.context}, {args.steps} steps"
    print(title)
    print(f"{'backend':<11}{'batch':>6}{'median ms':>11}{'p10':>8}{'p90':>8}{'tok/s':>9}")
    for r in rows:
        print(
            f"{r['backend']:<11}{r['batch']:>6}{r['median_ms']:>11.2f}{r['p10_ms']:>8.2f}{r['p90_ms']:>8.2f}"
            f"{r['tok_s']:>9.0f}"
        )
    md = (
        title
        + " (decode step ms)\n\n"
        + report.table(
            ("backend", "batch", "median ms", "p10 ms", "p90 ms", "tok/s"),
            [
                (
                    r["backend"],
                    r["batch"],
                    f"{r['median_ms']:.2f}",
                    f"{r['p10_ms']:.2f}",
                    f"{r['p90_ms']:.2f}",
                    f"{r['tok_s']:.0f}",
                )
                for r in rows
            ],
        )
    )
    print("wrote " + " and ".join(map(str, report.write_results("cuda_decode", result, md, started, out=args.out))))


if __name__ == "__main__":
    main()
