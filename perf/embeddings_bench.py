"""Embeddings throughput: inputs/s and tokens/s of POST /v1/embeddings at batch 1, 8 and 64
(inputs per call, one call at a time), on a server started with --is-embedding (the embedded
model by default). llama.cpp's `llama-server --embeddings` on the same GGUF would be the peer
(perf/peer_bench.py finds a build the same way); where none is installed the results say so.

    python -m perf.embeddings_bench                      # about 2 minutes on 2 cores
    python -m perf.embeddings_bench --rounds 3 --model-path /models/Qwen3-Embedding-0.6B
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import httpx

from perf import report
from perf.serving_bench import Server

BATCHES = (1, 8, 64)
WORDS = "the quick brown fox jumps over the lazy dog while a small server embeds every sentence".split()


def texts(n: int, words: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) + f" #{i}" for i in range(n)]


def measure(url: str, batch: int, words: int, calls: int) -> dict:
    """Medians over `calls` calls of `batch` inputs each (distinct texts: no prefix reuse across calls)."""
    seconds, tokens = [], 0
    with httpx.Client(timeout=600) as http:
        for c in range(calls):
            inputs = [f"{c}: {t}" for t in texts(batch, words)]
            t0 = time.perf_counter()
            r = http.post(url, json={"input": inputs})
            seconds.append(time.perf_counter() - t0)
            r.raise_for_status()
            tokens = r.json()["usage"]["prompt_tokens"]
    s = statistics.median(seconds)
    return {"batch": batch, "calls": calls, "median_s": s, "inputs_per_s": batch / s, "tokens_per_s": tokens / s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--words", type=int, default=48, help="words per input (about 60 tokens)")
    parser.add_argument("--rounds", type=int, default=5, help="calls per batch size")
    report.add_arguments(parser, "embeddings")
    args = parser.parse_args(argv)
    started = report.start(args, argv)
    extra = ["--is-embedding", *(["--model-path", args.model_path] if args.model_path else [])]
    log = args.out.with_name("embeddings_server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    server = Server(extra, log)
    try:
        server.wait_healthy()
        url = f"http://127.0.0.1:{server.port}/v1/embeddings"
        measure(url, 8, args.words, 1)  # warm-up
        rows = [measure(url, b, args.words, args.rounds) for b in BATCHES]
    finally:
        server.stop()
    peer = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    note = (
        f"llama.cpp: `{peer}` found but not run by this script yet."
        if peer
        else "llama.cpp: no `llama-server` on this machine ($LLAMA_SERVER unset, none on PATH): not compared."
    )
    md = report.table(
        ["batch", "median s / call", "inputs/s", "tokens/s"],
        [
            (r["batch"], report.fmt(r["median_s"], ".3f"), report.fmt(r["inputs_per_s"]), report.fmt(r["tokens_per_s"]))
            for r in rows
        ],
    )
    data = {"server_args": extra, "words": args.words, "results": rows, "peer": peer}
    json_path, md_path = report.write_results("embeddings", data, md + "\n\n" + note, started, out=args.out)
    print(md + "\n\n" + note)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
