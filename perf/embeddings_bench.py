"""Embeddings throughput, side by side with llama.cpp's server: inputs/s and tokens/s of
POST /v1/embeddings at batch 1, 8 and 64 (inputs per call, one call at a time), ringserve
started with --is-embedding and `llama-server --embeddings` on the same GGUF (the embedded
model by default), both up at once, the servers' order rotating round by round. Also what the
two compute: the cosine similarity of their vectors for the same inputs (the same blocks, the
same pooling: they should agree up to each one's arithmetic), and every process's RSS.

    python -m perf.embeddings_bench --llama-server /path/to/llama-server   # about 5 minutes on 2 cores
    python -m perf.embeddings_bench --gguf /models/model.gguf --pooling mean

Without a llama-server (--llama-server, $LLAMA_SERVER or PATH) ringserve is measured alone.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from perf import report
from perf import serving_bench as sb
from perf.peer_bench import LlamaServer, find_llama_server, llama_version, log_tail, tree_rss_mb

BATCHES = (1, 8, 64)
WORDS = "the quick brown fox jumps over the lazy dog while a small server embeds every sentence".split()
LLAMA = "llama.cpp"
RINGSERVE = "ringserve"
# llama.cpp at its best here: one slot per input of the largest batch (its server embeds a
# call's inputs in parallel slots), a batch that holds them all, both cores.
LLAMA_ARGS = "-np 64 -c 16384 -b 4096 -ub 4096 -t 2"


def texts(n: int, words: int, salt: str) -> list[str]:
    """n distinct inputs of `words` words; `salt` first so no call reuses another's prefix."""
    return [f"{salt} #{i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) for i in range(n)]


def embed(http: httpx.Client, url: str, inputs: list[str]) -> tuple[float, int, np.ndarray]:
    """Seconds, prompt tokens and the [len(inputs), dim] vectors of one call."""
    t0 = time.perf_counter()
    r = http.post(url, json={"input": inputs, "encoding_format": "float"})
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    body = r.json()
    vectors = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float64)
    return seconds, int(body["usage"]["prompt_tokens"]), vectors


def measure(http: httpx.Client, url: str, batch: int, words: int, calls: int, salt: str) -> dict:
    """Medians over `calls` calls of `batch` inputs each."""
    seconds, tokens = [], []
    for c in range(calls):
        s, t, _ = embed(http, url, texts(batch, words, f"{salt}.{c}"))
        seconds.append(s)
        tokens.append(t / s)
    s = statistics.median(seconds)
    return {"median_s": s, "inputs_per_s": batch / s, "tokens_per_s": statistics.median(tokens)}


def agreement(http: httpx.Client, urls: dict[str, str], words: int) -> dict:
    """Cosine similarity of llama.cpp's and ringserve's vectors for the same 16 inputs."""
    inputs = texts(16, words, "agreement")
    a = embed(http, urls[LLAMA], inputs)[2]
    b = embed(http, urls[RINGSERVE], inputs)[2]
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return {"inputs": len(inputs), "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean())}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, then PATH)")
    ap.add_argument("--llama-args", default=LLAMA_ARGS, help="llama-server flags besides -m/--embeddings/--pooling")
    ap.add_argument("--gguf", default=None, help="the GGUF both serve (default: ringserve's embedded model)")
    ap.add_argument("--pooling", default="last", choices=("last", "mean", "cls"), help="both servers' pooling")
    ap.add_argument("--ringserve-args", default="", help="more ringserve flags, one string")
    ap.add_argument("--words", type=int, default=48, help="words per input (about 60 tokens)")
    ap.add_argument("--calls", type=int, default=3, help="calls per batch size, server and round")
    ap.add_argument("--rounds", type=int, default=3)
    report.add_arguments(ap, "embeddings")
    return ap.parse_args(argv)


def start(args: argparse.Namespace, gguf: str, llama_bin: str | None) -> dict[str, object]:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers: dict[str, object] = {}
    if llama_bin is not None:
        flags = ["--embeddings", "--pooling", args.pooling, *shlex.split(args.llama_args)]
        servers[LLAMA] = LlamaServer(llama_bin, gguf, flags, args.out.with_name("embeddings_server_llama.log"))
    flags = ["--is-embedding", "--pooling", args.pooling, "--model-path", gguf, *shlex.split(args.ringserve_args)]
    servers[RINGSERVE] = sb.Server(flags, args.out.with_name("embeddings_server_ringserve.log"))
    return servers


def markdown(data: dict) -> str:
    names = list(data["servers"])
    lines = [
        report.table(
            ["server", "command", "start s", "RSS MB (peak), all processes"],
            [
                (
                    n,
                    f"`{' '.join(s['argv'])}`",
                    report.fmt(s["startup_s"]),
                    f"{report.fmt(s['rss']['rss'])} ({report.fmt(s['rss']['peak'])})",
                )
                for n, s in data["servers"].items()
            ],
        ),
        "",
        report.table(
            ["batch", *(f"{n} inputs/s" for n in names), *(f"{n} tokens/s" for n in names)]
            + (["ringserve ÷ llama.cpp"] if LLAMA in names else []),
            [
                (
                    row["batch"],
                    *(report.fmt(row[n]["inputs_per_s"]) for n in names),
                    *(report.fmt(row[n]["tokens_per_s"]) for n in names),
                    *([report.fmt(row["ratio"], ".2f")] if LLAMA in names else []),
                )
                for row in data["summary"]
            ],
        ),
    ]
    if "agreement" in data:
        ag = data["agreement"]
        lines += [
            "",
            f"Cosine similarity of the two servers' vectors for the same {ag['inputs']} inputs: "
            f"mean {ag['cosine_mean']:.6f}, min {ag['cosine_min']:.6f}.",
        ]
    else:
        lines += ["", f"llama.cpp: {data['llama_cpp']}: not compared."]
    lines += [
        "",
        f"{data['rounds']} rounds, servers in rotating order; per round, batch and server {data['calls']} calls "
        f"of distinct ~{data['words']}-word inputs, one at a time; a row's values are the medians over rounds, "
        "the ratio the median of the rounds' ringserve ÷ llama.cpp inputs/s.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from gpu.models.model_files import default_model_path

    args = parse_args(argv)
    started = report.start(args, argv)
    gguf = args.gguf or str(default_model_path())
    llama_bin = find_llama_server(args.llama_server)
    servers = start(args, gguf, llama_bin)
    data: dict = {
        "gguf": Path(gguf).name,
        "pooling": args.pooling,
        "words": args.words,
        "calls": args.calls,
        "rounds": args.rounds,
        "llama_cpp": llama_version(llama_bin) if llama_bin else "no llama-server (--llama-server, $LLAMA_SERVER, PATH)",
        "servers": {},
    }
    per_round: list[dict] = []
    try:
        for name, server in servers.items():
            try:
                startup = server.wait_healthy()
            except (RuntimeError, TimeoutError) as e:
                raise SystemExit(f"{name} did not start: {e}: {log_tail(server.log)}") from e
            argv_shown = ["python", *server.argv[1:]] if name == RINGSERVE else server.argv
            data["servers"][name] = {"argv": argv_shown, "startup_s": startup}
        urls = {n: f"http://127.0.0.1:{s.port}/v1/embeddings" for n, s in servers.items()}
        with httpx.Client(timeout=600) as http:
            for name in servers:
                measure(http, urls[name], 8, args.words, 1, "warm-up")
            if LLAMA in servers:
                data["agreement"] = agreement(http, urls, args.words)
            for r in range(args.rounds):
                order = list(servers)[r % len(servers) :] + list(servers)[: r % len(servers)]
                per_round.append(
                    {
                        str(b): {n: measure(http, urls[n], b, args.words, args.calls, f"r{r}.{n}.{b}") for n in order}
                        for b in BATCHES
                    }
                )
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        for name, server in servers.items():
            data["servers"][name]["rss"] = tree_rss_mb({p: 0 for p in sb.descendants(server.proc.pid)})
    finally:
        leftovers = {name: server.stop() for name, server in servers.items()}
    data["leftovers"] = leftovers
    data["per_round"] = per_round
    data["summary"] = []
    for b in BATCHES:
        rows = [rnd[str(b)] for rnd in per_round]
        row: dict = {"batch": b}
        for name in servers:
            row[name] = {k: statistics.median(x[name][k] for x in rows) for k in ("inputs_per_s", "tokens_per_s")}
        if LLAMA in servers:
            row["ratio"] = statistics.median(x[RINGSERVE]["inputs_per_s"] / x[LLAMA]["inputs_per_s"] for x in rows)
        data["summary"].append(row)
    md = markdown(data)
    json_path, md_path = report.write_results("embeddings", data, md, started, out=args.out)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
