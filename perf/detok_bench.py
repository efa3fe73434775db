"""Detokenizer CPU cost per streamed token, at batch 1, 64 and 256 (one token per request per
step, steady state), for:
  table          BatchDetokenizer, numpy byte table (byte-level BPE fast path)
  table+stop     the same, every request with two stop strings that never match
  window         BatchDetokenizer forced onto the window decode (one batch_decode per step)
  per-request    the classic loop: per request per step, tokenizer.decode of its window
                 (surrogate/read offsets), one request at a time
  router         the detokenizer process's whole per-batch work minus the ring: TOKEN_OUT
                 records in, Detokenizer.handle, TEXT_OUT records + payload out
Prints a table; writes perf/results/detok.json and detok.md (perf/report.py).

    python -m perf.detok_bench [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from transformers import AutoTokenizer

from gpu.models.model_files import resolve_model_dir
from ipc.ring import Batch
from perf import report
from protocol.records import TOKEN_OUT, OpenFlags, TokenKind
from runtime.detokenizer.core import Detokenizer
from runtime.detokenizer.incremental import BatchDetokenizer, DetokOptions

BATCHES = (1, 64, 256)
WARMUP_STEPS = 10
CORPORA = {
    # what a chat model mostly streams: English prose, lists and code
    "english": (
        "Sure! Here is a short overview of how continuous batching works in an inference server.\n\n"
        "1. **Scheduling**: every step, the scheduler looks at the running requests and the waiting "
        "queue. Requests that finished free their KV-cache pages, and new requests are admitted while "
        "the token budget allows it. Long prompts are split into chunks so that decoding requests are "
        "not stalled for hundreds of milliseconds.\n"
        "2. **Forward pass**: the model runs once over the mixed batch of prefill chunks and decode "
        "tokens; attention reads the paged KV cache through a page table.\n"
        "3. **Sampling**: temperature, top-p and top-k are applied per request, then one token per "
        "request is appended to its output.\n\n"
        "```python\ndef step(self) -> list[Output]:\n    batch = self.planner.plan(self.running, self.waiting)\n"
        "    logits = self.model.forward(batch)\n    return self.sampler.sample(logits, batch)\n```\n\n"
        "In practice, the throughput gain over static batching is 2-3x, because short requests leave "
        "the batch early instead of waiting for the longest one — the café analogy: tables are reused "
        "as soon as guests leave. "
    )
    * 8,
    # worst case for the byte table's vectorised path: most tokens are pieces of characters
    "multilingual": (
        "Résumé, naïve café, déjà vu. 世界你好，今天天气很好。 こんにちは、元気ですか？ "
        "Emoji: 😀🤖🎉👍🏽 and symbols ∑∫√ ≤ ≥. Привет, как дела? Ελληνικά. "
    )
    * 30,
}


class PerRequestDecode:
    """Baseline: SGLang's surrogate/read offsets, but tokenizer.decode per request, no batching."""

    def __init__(self, tokenizer, n: int) -> None:
        self.tokenizer = tokenizer
        self.ids = [[] for _ in range(n)]
        self.surr = [0] * n
        self.read = [0] * n

    def step(self, req: np.ndarray, token: np.ndarray, finished: np.ndarray) -> list[tuple[int, bytes]]:
        out = []
        for r, t in zip(req.tolist(), token.tolist()):
            ids = self.ids[r]
            ids.append(t)
            surr = self.tokenizer.decode(ids[self.surr[r] : self.read[r]], skip_special_tokens=True)
            full = self.tokenizer.decode(ids[self.surr[r] :], skip_special_tokens=True)
            new = full[len(surr) :]
            if new and not new.endswith("\ufffd"):
                out.append((r, new.encode()))
                self.surr[r], self.read[r] = self.read[r], len(ids)
        return out


class RouterStep:
    """Feeds the Detokenizer core one TOKEN_OUT record per request per step (what the process pops)."""

    def __init__(self, tokenizer, n: int) -> None:
        self.router = Detokenizer(tokenizer, max_open=n)
        opens = np.zeros(n, TOKEN_OUT.dtype)
        opens["kind"], opens["slot"], opens["gen"] = TokenKind.OPEN, np.arange(n), 1
        opens["flags"] = OpenFlags.SKIP_SPECIAL_TOKENS
        self.router.handle(Batch(opens, np.zeros(0, np.uint8)))
        self.records = np.zeros(n, TOKEN_OUT.dtype)
        self.records["slot"], self.records["gen"] = np.arange(n), 1
        self.empty = np.zeros(0, np.uint8)

    def step(self, req: np.ndarray, token: np.ndarray, finished: np.ndarray):
        recs = self.records[: len(req)]
        recs["token"] = token
        records, blob = self.router.handle(Batch(recs, self.empty))
        return blob


def measure(make, corpus_ids: np.ndarray, batch: int, seconds: float, rng) -> dict:
    """Steady-state µs per token: each request streams the corpus from its own offset."""
    det = make()
    offsets = rng.integers(0, len(corpus_ids) // 2, batch)
    req = np.arange(batch)
    finished = np.zeros(batch, bool)
    for k in range(WARMUP_STEPS):
        det.step(req, corpus_ids[(offsets - WARMUP_STEPS + k) % len(corpus_ids)], finished)
    steps, elapsed, cpu = 0, 0.0, 0.0
    chars = 0
    while elapsed < seconds or steps < 20:
        token = corpus_ids[(offsets + steps) % len(corpus_ids)]
        t0, c0 = time.perf_counter(), time.process_time()
        out = det.step(req, token, finished)
        elapsed += time.perf_counter() - t0
        cpu += time.process_time() - c0
        chars += (
            len(out.text)
            if hasattr(out, "text")
            else len(out)
            if hasattr(out, "dtype")
            else sum(len(b) for _, b in out)
        )
        steps += 1
    tokens = steps * batch
    return {
        "batch": batch,
        "steps": steps,
        "tokens": tokens,
        "us_per_token": 1e6 * elapsed / tokens,
        "cpu_us_per_token": 1e6 * cpu / tokens,
        "us_per_step": 1e6 * elapsed / steps,
        "bytes_out": chars,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per configuration")
    report.add_arguments(ap, "detok")
    args = ap.parse_args()
    started = report.start(args)

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    cap = max(BATCHES)

    def batch_detok(use_table: bool, options: DetokOptions):
        det = BatchDetokenizer(tokenizer, cap, use_byte_table=use_table)
        assert use_table == (det.table is not None), det.fallback_reason
        return lambda: _opened(det, options)

    no_stop = DetokOptions()
    variants = {
        "table": batch_detok(True, no_stop),
        "table+stop": batch_detok(True, DetokOptions(stop=("<never>", "\n\n\n\n"))),
        "window": batch_detok(False, no_stop),
        "per-request": lambda: PerRequestDecode(tokenizer, cap),
        "router": lambda: RouterStep(tokenizer, cap),
    }
    rng = np.random.default_rng(0)
    results = []
    for corpus, text in CORPORA.items():
        corpus_ids = np.array(tokenizer.encode(text, add_special_tokens=False), np.int64)
        partial = np.mean(["\ufffd" in tokenizer.decode([i]) for i in corpus_ids])
        for name, make in variants.items():
            for b in BATCHES:
                results.append(
                    {
                        "corpus": corpus,
                        "partial_token_fraction": round(float(partial), 3),
                        "variant": name,
                        **measure(make, corpus_ids, b, args.seconds, rng),
                    }
                )

    print(f"{'corpus':<13} {'variant':<12} {'batch':>5} {'µs/token':>9} {'cpu µs/tok':>10} {'µs/step':>9} {'steps':>6}")
    for r in results:
        print(
            f"{r['corpus']:<13} {r['variant']:<12} {r['batch']:>5} {r['us_per_token']:>9.2f} "
            f"{r['cpu_us_per_token']:>10.2f} {r['us_per_step']:>9.1f} {r['steps']:>6}"
        )
    partial = "partial_token_fraction: " + ", ".join(
        f"{c} {r['partial_token_fraction']}" for c, r in {r["corpus"]: r for r in results}.items()
    )
    print(partial)
    md = report.table(
        ("corpus", "variant", "batch", "µs/token", "CPU µs/token", "µs/step", "steps"),
        [
            (
                r["corpus"],
                r["variant"],
                r["batch"],
                f"{r['us_per_token']:.2f}",
                f"{r['cpu_us_per_token']:.2f}",
                f"{r['us_per_step']:.1f}",
                r["steps"],
            )
            for r in results
        ],
    )
    md += f"\n\n{args.seconds:g} s timed per configuration; {partial} (tokens that decode to part of a character)."
    paths = report.write_results(
        "detok", {"seconds_per_config": args.seconds, "results": results}, md, started, out=args.out
    )
    print("wrote " + " and ".join(map(str, paths)))


def _opened(det: BatchDetokenizer, options: DetokOptions) -> BatchDetokenizer:
    for r in range(det.capacity):
        det.open(r, options)
    return det


if __name__ == "__main__":
    main()
