"""Quality of each numeric mode against the exact computation (fp32 weights dequantized from
the GGUF, fp32 KV cache), teacher-forced over the fixed corpus tests/data/quality_corpus/:
perplexity, mean KL(exact || mode) per token in nats, top-1 agreement with exact; and each
mode's speed (decode step at batch 1 and 8, one prefill) timed in interleaved rounds.

Each document is cut into --window-token windows, each run from position 0 through the mode's
own ModelRunner (paged KV cache in the mode's dtype, attention backend, quantized kernels) in
--chunk-token chunks, as chunked prefill runs a long prompt: every chunk's attention reads the
earlier chunks' K/V from the cache. Every position's full-vocabulary logits come from
model.hidden / model.logits, the path of ModelRunner.step's prompt logprobs. Writes
perf/results/quality.json and quality.md.

    python -m perf.quality [--window 512] [--chunk 128] [--modes none,gguf-q8,...] [--rounds 3]
    python -m perf.quality --gguf gemma-3-270m-q4_k_m.gguf --reference gguf-q8 --modes gguf-q8+kv-f16 \
        --windows 4 --window 256 --rounds 0     # another GGUF; what fp16 KV changes in the default mode
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.model_runner import ModelRunner, ModelRunnerConfig
from gpu.models.model_files import resolve_model_dir
from perf import report
from protocol.sampling_params import SamplingParams

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "quality_corpus"
KV_NAMES = {"float32": "", "float16": "+kv-f16", "bfloat16": "+kv-bf16"}


def modes(hf_dir: str, gguf: str | None = None) -> dict[str, dict]:
    """Every mode measured, by name: ModelRunnerConfig fields over the defaults (on the CPU,
    the GGUF `gguf`, else the embedded model's). bf16, the embedded model's only: its converted
    HF directory (the GGUF's values in bf16). `none` is the exact computation."""
    model = {} if gguf is None else {"model_path": gguf}
    out = {
        q + KV_NAMES[kv]: {"quantization": q, "dtype": "float32", "kv_cache_dtype": kv, **model}
        for q in ("none", "gguf", "gguf-q8")
        for kv in KV_NAMES
    }
    if gguf is None:
        out["bf16"] = {"quantization": "none", "dtype": "bfloat16", "kv_cache_dtype": "auto", "model_path": hf_dir}
    return out


def corpus_windows(tokenizer, window: int, corpus: Path = CORPUS) -> list[np.ndarray]:
    """Each document's tokens cut into windows of at most `window` (the last one shorter)."""
    out = []
    for doc in sorted(corpus.glob("*.txt")):
        ids = np.asarray(tokenizer.encode(doc.read_text()), dtype=np.int32)
        out += [ids[a : a + window] for a in range(0, len(ids) - 1, window) if len(ids) - a >= 2]
    return out


def pick(windows: list[np.ndarray], n: int) -> list[np.ndarray]:
    """n windows evenly spaced over the corpus, so that every document has its say (0: all)."""
    if n <= 0 or n >= len(windows):
        return windows
    return [windows[int(i)] for i in np.linspace(0, len(windows) - 1, n).round()]


def runner_for(config: Mapping, max_tokens: int, rows: int = 1) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(device="cpu", max_total_tokens=max_tokens, max_running_requests=rows, **config)
    )


@torch.inference_mode()
def window_logprobs(runner: ModelRunner, ids: np.ndarray, chunk: int) -> torch.Tensor:
    """float32 [len(ids) - 1, V]: the log-softmax of the logits at every position but the last
    (each predicts the next token), the window run in chunks through the paged KV cache."""
    pool, page = runner.pool, runner.config.page_size
    pages = pool.alloc(pool.pages_for(len(ids)))
    try:
        parts = []
        for a in range(0, len(ids), chunk):
            part = ids[a : a + chunk]
            batch = build_forward_batch(
                [SeqInput(0, part, a, pages, False)], page, runner.model_config.context_length, runner.device
            )
            runner.attn.plan(batch.meta)
            x, residual = runner.model.hidden(batch.input_ids, batch.meta.positions, runner.attn)
            parts.append(torch.log_softmax(runner.model.logits(x, residual, torch.arange(len(part))), dim=-1))
        return torch.cat(parts)[:-1]
    finally:
        pool.free(pages)


def measure(
    configs: Mapping[str, Mapping],
    windows: Sequence[np.ndarray],
    chunk: int,
    reference: Mapping,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """For each config (ModelRunnerConfig fields), teacher-forced over `windows`: perplexity,
    mean KL(reference || config) per predicted token in nats, top-1 agreement with the
    reference (each config runs in its own ModelRunner, the reference too)."""
    max_tokens = max(len(w) for w in windows)
    ref_runner = runner_for(reference, max_tokens)
    refs = [window_logprobs(ref_runner, w, chunk) for w in windows]
    del ref_runner
    out = {}
    for name, config in configs.items():
        runner = runner_for(config, max_tokens)
        nll = kl = agree = 0.0
        n = 0
        for ids, ref in zip(windows, refs):
            lp = window_logprobs(runner, ids, chunk)
            targets = torch.from_numpy(ids[1:].astype(np.int64))[:, None]
            nll -= lp.gather(1, targets).double().sum().item()
            kl += (ref.exp() * (ref - lp)).sum(dim=1).double().sum().item()
            agree += (lp.argmax(dim=1) == ref.argmax(dim=1)).sum().item()
            n += len(ref)
        out[name] = {
            "config": dict(config),
            "quantization": runner.quantization,
            "dtype": str(runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
            "attention_backend": runner.attention_backend,
            "tokens": n,
            "perplexity": float(np.exp(nll / n)),
            "mean_kl": kl / n,
            "top1_agreement": agree / n,
        }
        if progress is not None:
            progress(f"{name}: {out[name]}")
        del runner
        gc.collect()
    return out


def speeds(
    configs: Mapping[str, Mapping],
    prompts: np.ndarray,
    prefill: np.ndarray,
    batches: Sequence[int],
    steps: int,
    rounds: int,
) -> dict[str, dict]:
    """Per config: ms per decode step at each batch (every row holding the prompt's tokens),
    and ms for one prefill of `prefill`, through ModelRunner.step (the C decode loop where it
    applies), best of `rounds` with the configs interleaved in each round."""
    B, ctx = max(batches), prompts.shape[1]
    need = B * (ctx + 1 + steps * (rounds + 1)) * 2 + len(prefill) + 64
    runners = {name: runner_for(c, need, B) for name, c in configs.items()}
    greedy = SamplingParams(temperature=0.0)
    best: dict[str, dict[str, float]] = {name: {} for name in runners}

    def decode(runner: ModelRunner, b: int) -> float:
        pool = runner.pool
        pages = [pool.alloc(pool.pages_for(ctx + 1 + steps)) for _ in range(b)]
        try:
            for row in range(b):
                runner.set_request(row, greedy, prompts[row], np.zeros(0, np.int32))
            out = runner.step([SeqInput(r, prompts[r], 0, pages[r], True) for r in range(b)])
            out = runner.step([SeqInput(r, out.tokens[r : r + 1], ctx, pages[r], True) for r in range(b)])  # warm
            t = time.perf_counter()
            for i in range(1, steps):
                out = runner.step([SeqInput(r, out.tokens[r : r + 1], ctx + i, pages[r], True) for r in range(b)])
            return (time.perf_counter() - t) / (steps - 1) * 1e3
        finally:
            for p in pages:
                pool.free(p)

    def prefill_ms(runner: ModelRunner) -> float:
        pages = runner.pool.alloc(runner.pool.pages_for(len(prefill)))
        try:
            runner.set_request(0, greedy, prefill, np.zeros(0, np.int32))
            t = time.perf_counter()
            runner.step([SeqInput(0, prefill, 0, pages, True)])
            return (time.perf_counter() - t) * 1e3
        finally:
            runner.pool.free(pages)

    with torch.inference_mode():
        for _ in range(rounds):
            for name, runner in runners.items():
                times = {f"decode_b{b}_ms": decode(runner, b) for b in batches}
                times["prefill_ms"] = prefill_ms(runner)
                for key, ms in times.items():
                    best[name][key] = min(ms, best[name].get(key, float("inf")))
    return best


def markdown(quality: dict[str, dict], speed: dict[str, dict], args: argparse.Namespace, windows: int) -> str:
    exact_ppl = quality["none"]["perplexity"] if "none" in quality else None
    columns = ["mode", "weights", "dtype", "KV cache", "perplexity", "vs exact", "mean KL (nats/token)", "top-1 agree"]
    columns += [f"decode b={b} ms" for b in args.batches] + [f"prefill {args.prefill} tok ms"]
    rows = []
    for name, q in quality.items():
        s = speed.get(name, {})
        rows.append(
            [
                name,
                q["quantization"],
                q["dtype"],
                q["kv_cache_dtype"],
                report.fmt(q["perplexity"], ".4f"),
                "-" if exact_ppl is None else f"{(q['perplexity'] / exact_ppl - 1) * 100:+.2f}%",
                report.fmt(q["mean_kl"], ".5f"),
                report.fmt(q["top1_agreement"] * 100, ".2f") + "%",
                *(report.fmt(s.get(f"decode_b{b}_ms")) for b in args.batches),
                report.fmt(s.get("prefill_ms")),
            ]
        )
    tokens = next(iter(quality.values()))["tokens"]
    reference = (
        "the exact mode (`none`: fp32 weights dequantized from the GGUF, fp32 KV cache)"
        if args.reference == "none"
        else f"`{args.reference}`"
    )
    return "\n\n".join(
        [
            f"{args.gguf or 'The embedded SmolLM2-135M-Instruct Q4_1 GGUF'}, teacher-forced over "
            f"tests/data/quality_corpus/ ({tokens} predicted tokens in {windows} windows of at most {args.window} "
            f"tokens, run in chunks of {args.chunk}); reference: {reference}. KL(reference || mode) per token; "
            f"top-1: the mode's likeliest token is the reference's. Speed: {torch.get_num_threads()} torch threads, "
            f"best of {args.rounds} interleaved rounds, decode at a context of {args.context} tokens per row, ms "
            "per step (load: header).",
            report.table(columns, rows),
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    model = argparse.ArgumentParser(add_help=False)  # the modes' names and configs follow the model
    model.add_argument("--gguf", default=None, help="the GGUF the modes run (default: the embedded SmolLM2)")
    gguf = model.parse_known_args(argv)[0].gguf
    hf_dir = str(resolve_model_dir(gguf))
    all_modes = modes(hf_dir, gguf)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[model])
    ap.add_argument("--reference", default="none", choices=all_modes, help="the mode the others are measured against")
    ap.add_argument("--windows", type=int, default=0, help="windows measured, evenly spaced (0: all)")
    ap.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    ap.add_argument("--chunk", type=int, default=128, help="tokens per forward (chunked prefill)")
    ap.add_argument("--modes", default=",".join(all_modes), help=f"comma-separated, of {', '.join(all_modes)}")
    ap.add_argument("--batches", default="1,8", type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--context", type=int, default=128, help="prompt tokens a row holds in the decode timing")
    ap.add_argument("--prefill", type=int, default=110, help="tokens of the timed prefill")
    ap.add_argument("--steps", type=int, default=9, help="decode steps a timing (the first is a warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="speed rounds (0: no speed)")
    report.add_arguments(ap, "quality")
    args = ap.parse_args(argv)
    started = report.start(args, argv)
    chosen = {name: all_modes[name] for name in args.modes.split(",")}

    from transformers import AutoTokenizer

    windows = pick(corpus_windows(AutoTokenizer.from_pretrained(hf_dir), args.window), args.windows)
    quality = measure(chosen, windows, args.chunk, all_modes[args.reference], progress=print)
    speed = {}
    if args.rounds:
        flat = np.concatenate(windows)
        prompts = np.stack([flat[i * args.context : (i + 1) * args.context] for i in range(max(args.batches))])
        speed = speeds(chosen, prompts, flat[: args.prefill], args.batches, args.steps, args.rounds)
    text = markdown(quality, speed, args, len(windows))
    print(text)
    data = {
        "gguf": args.gguf,
        "reference": args.reference,
        "window": args.window,
        "chunk": args.chunk,
        "windows": len(windows),
        "threads": torch.get_num_threads(),
        "context": args.context,
        "prefill_tokens": args.prefill,
        "rounds": args.rounds,
        "modes": {name: {**q, **speed.get(name, {})} for name, q in quality.items()},
    }
    report.write_results("quality", data, text, started, out=args.out)


if __name__ == "__main__":
    main()
