"""Where the time to first token goes at concurrency 1: from the request's bytes to the first
SSE event, stage by stage, for streamed /v1/completions and /v1/chat/completions.

The server runs with RINGSERVE_TRACE_TTFT=<dir>: each process then runs its traced variant,
which appends one line of CLOCK_MONOTONIC stamps per request's first-token path
(runtime/ttft_trace.py TtftTrace; CLOCK_MONOTONIC is system-wide on Linux, and
time.perf_counter reads it too, so the client's send and first-event times join them). The
lines are joined by (worker, slot, gen) and matched to the client's requests by time (one
request at a time). Medians and p90 per stage, per endpoint and model: the null model (instant
tokens: the server's own path) and the real one (adds the prefill forward and the sampler).

Also, on the real model: the TTFT of a ~1000-token prompt whose prefix another request left in
the radix cache against one that computes it (pairs of fresh prefixes, same run); and with
`--base TREE`, an A/B of plain (untraced) c=1 TTFT between another checkout (A) and this one
(B), requests alternating between the two servers, both up at once.

    python -m perf.ttft_breakdown                                   # null and real (gguf-q8, fp16 KV)
    python -m perf.ttft_breakdown --models null --requests 200
    git worktree add /tmp/base HEAD~1 && python -m perf.ttft_breakdown --base /tmp/base --models null
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from perf import report
from perf import serving_bench as sb

ROOT = Path(__file__).resolve().parents[1]
TRACE_ENV = "RINGSERVE_TRACE_TTFT"
REAL_ARGS = "--quantization gguf-q8 --kv-cache-dtype float16"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# (stage, from stamp, to stamp), in path order; client_send / client_first are the client's
STAGES = (
    ("HTTP read, parse, validate", "client_send", "w_parsed"),
    ("chat template", "w_parsed", "w_templated"),
    ("tokenize", "w_templated", "w_encoded"),
    ("sampling params, checks", "w_encoded", "w_submit"),
    ("pack + REQUEST push", "w_submit", "w_pushed"),
    ("REQUEST ring + scheduler wake", "w_pushed", "s_pop"),
    ("add_request", "s_pop", "s_added"),
    ("admission (schedule)", "s_added", "forward"),
    ("prefill forward", "forward", "sample"),
    ("sampling", "sample", "stepped"),
    ("step bookkeeping (append, stops)", "stepped", "s_send"),
    ("OPEN + TOKEN pack, TOKEN_OUT push", "s_send", "s_pushed"),
    ("TOKEN_OUT ring + detokenizer wake", "s_pushed", "d_pop"),
    ("detokenize", "d_pop", "d_decoded"),
    ("TEXT_OUT push", "d_decoded", "d_pushed"),
    ("TEXT_OUT ring + worker wake", "d_pushed", "w_pop"),
    ("dispatch + request coroutine wake", "w_pop", "w_woken"),
    ("SSE render, write, client read", "w_woken", "client_first"),
)


class TracedServer(sb.Server):
    """serving_bench's server with RINGSERVE_TRACE_TTFT set: granian started as `runtime serve`
    starts it, but directly (`serve` passes no RINGSERVE_* variable of its environment on)."""

    def __init__(self, extra_args: list[str], log: Path, trace_dir: str) -> None:
        from runtime.__main__ import granian_command, server_env
        from runtime.config import ServerArgs

        self.port = sb.free_port()
        self.extra_args = extra_args
        server_args = ServerArgs.from_cli(["--port", str(self.port), "--log-level", "warning", *extra_args])
        self.argv = granian_command(server_args)
        self._launch({**server_env(server_args), TRACE_ENV: trace_dir}, log, ROOT)


def body(endpoint: str, model: str, text: str | list[int], output_tokens: int) -> bytes:
    common = {
        "model": model,
        "max_tokens": output_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        return orjson.dumps({**common, "messages": [{"role": "user", "content": text}]})
    return orjson.dumps({**common, "prompt": text})


_CONNECTIONS: dict[tuple[int, str], sb.StreamConnection] = {}


async def one(server: sb.Server, endpoint: str, payload: bytes, timeout: float) -> sb.RequestResult:
    """One request on the keep-alive connection of its server and endpoint (opened at its first)."""
    conn = _CONNECTIONS.get((server.port, endpoint))
    if conn is None or conn.closed:
        conn = _CONNECTIONS[server.port, endpoint] = await sb.connect("127.0.0.1", server.port, ENDPOINTS[endpoint])
    return await conn.request(payload, timeout)


def read_traces(directory: Path) -> list[dict[str, int]]:
    """Every request's stamps, its processes' lines joined by (worker, slot, gen)."""
    joined: dict[tuple[int, ...], dict[str, int]] = {}
    for path in sorted(directory.glob("*.tsv")):
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            key = tuple(map(int, fields[:3]))
            stamps = joined.setdefault(key, {})
            for item in fields[3:]:
                name, _, value = item.partition("=")
                stamps[name] = int(value)
    return list(joined.values())


def match(results: list[tuple[str, sb.RequestResult]], traces: list[dict[str, int]]) -> list[tuple[str, dict]]:
    """Each client request with the server stamps of the one traced request inside its window."""
    by_parse = sorted((t["w_parsed"], t) for t in traces if "w_parsed" in t)
    out = []
    for endpoint, r in results:
        if r.error or not r.content_times:
            continue
        lo, hi = int(r.start * 1e9), int(r.content_times[0] * 1e9)
        inside = [t for ns, t in by_parse if lo <= ns <= hi]
        if len(inside) == 1:
            out.append((endpoint, {**inside[0], "client_send": lo, "client_first": hi}))
    return out


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def breakdown(samples: list[dict]) -> dict:
    """Per stage: median and p90 ms, and the median's share of the median TTFT."""
    stages = {}
    for name, a, b in STAGES:
        if name == "prefill forward" and not any("sample" in s for s in samples):
            b = "stepped"  # the null model has no sampler: its whole step is the "forward"
        ms = [(s[b] - s[a]) / 1e6 for s in samples if a in s and b in s]
        at = [(s[b] - s["client_send"]) / 1e6 for s in samples if b in s]
        if ms:
            stages[name] = {
                "p50_ms": statistics.median(ms),
                "p90_ms": pct(ms, 0.9),
                "end_p50_ms": statistics.median(at),
                "n": len(ms),
            }
    ttft = [(s["client_first"] - s["client_send"]) / 1e6 for s in samples]
    return {
        "requests": len(samples),
        "ttft_p50_ms": statistics.median(ttft) if ttft else None,
        "ttft_p90_ms": pct(ttft, 0.9),
        "sum_of_stage_p50_ms": sum(v["p50_ms"] for v in stages.values()),
        "stages": stages,
    }


def run_model(model: str, args, loop, tokenizer, out_dir: Path) -> dict:
    extra = shlex.split(args.real_args if model == "real" else "--null-model") + shlex.split(args.server_args)
    with tempfile.TemporaryDirectory(prefix="ttft-trace-") as trace_dir:
        server = TracedServer(extra, out_dir / f"ttft_{model}.log", trace_dir)
        try:
            server.wait_healthy()
            name = server.model_name()
            n = args.warmup + (args.real_requests if model == "real" else args.requests)
            chat_texts, chat_lengths = sb.make_prompts(tokenizer, n, args.prompt_tokens, 1)
            plain_texts, plain_lengths = sb.make_prompts(
                tokenizer, n, args.prompt_tokens, 2, count=lambda t: len(tokenizer(t)["input_ids"])
            )
            results = []
            for i in range(n):
                for endpoint, texts in (("completions", plain_texts), ("chat", chat_texts)):
                    payload = body(endpoint, name, texts[i], args.output_tokens)
                    r = loop.run_until_complete(one(server, endpoint, payload, args.request_timeout))
                    if i >= args.warmup:
                        results.append((endpoint, r))
                    time.sleep(args.gap_ms / 1e3)  # the processes go to sleep, as between a user's requests
            prefix = prefix_reuse(server, name, tokenizer, loop, args) if model == "real" else None
        finally:
            leftovers = server.stop()
        samples = match(results, read_traces(Path(trace_dir)))
    per_endpoint = {ep: breakdown([s for e, s in samples if e == ep]) for ep in ENDPOINTS}
    return {
        "server_args": extra,
        "prompt_tokens_p50": {"completions": statistics.median(plain_lengths), "chat": statistics.median(chat_lengths)},
        "failed": sum(1 for _, r in results if r.error),
        "unmatched": len(results) - len(samples),
        "endpoints": per_endpoint,
        "prefix_reuse": prefix,
        "leftovers": leftovers,
    }


def prefix_reuse(server: sb.Server, name: str, tokenizer, loop, args) -> dict:
    """TTFT of a prompt that computes its ~prefix_tokens prefix, then of one that finds it cached."""
    words = sb.vocab_words(tokenizer)
    cold, warm, cached = [], [], []
    for k in range(args.prefix_pairs):
        prefix = " ".join(words[(k * 997 + 31 * j) % len(words)] for j in range(args.prefix_tokens))
        ids = tokenizer(prefix, add_special_tokens=False)["input_ids"][: args.prefix_tokens]
        for side, tail in ((cold, " First question."), (warm, " Second question.")):
            prompt = ids + tokenizer(tail, add_special_tokens=False)["input_ids"]
            r = loop.run_until_complete(
                one(server, "completions", body("completions", name, prompt, 4), args.request_timeout)
            )
            if r.error or not r.content_times:
                raise RuntimeError(f"prefix request failed: {r.error}")
            side.append((r.content_times[0] - r.start) * 1e3)
            if side is warm:
                cached.append(r.cached_tokens)
    return {
        "prefix_tokens": args.prefix_tokens,
        "pairs": args.prefix_pairs,
        "uncached_ttft_ms": cold,
        "cached_ttft_ms": warm,
        "cached_tokens": cached,
        "ratio_p50": statistics.median(warm) / statistics.median(cold),
    }


def prefill_forward(args) -> dict:
    """The real model's prefill of one prompt_tokens-token prompt in this process, as the
    scheduler's runner takes it (gguf-q8, fp16 KV by default), at 1 and 2 threads: wall and
    this process's CPU ms, median and min of --prefill-runs, and the sampler's share."""
    import numpy as np
    import torch

    from gpu.model_runner import ModelRunner, ModelRunnerConfig, SeqInput
    from protocol.sampling_params import SamplingParams
    from runtime.config import ServerArgs

    server_args = ServerArgs.from_cli(shlex.split(args.real_args))
    runner = ModelRunner(
        ModelRunnerConfig(
            quantization=server_args.quantization,
            kv_cache_dtype=server_args.kv_cache_dtype,
            max_running_requests=1,
            max_total_tokens=4 * args.prompt_tokens + 64,
        )
    )
    prompt = np.random.default_rng(0).integers(100, runner.model_config.vocab_size, args.prompt_tokens).astype(np.int32)
    pages = runner.pool.alloc(runner.pool.pages_for(args.prompt_tokens))
    sample = runner.sampler.sample
    sampled: list[float] = []

    def timed_sample(*a, **kw):
        t = time.perf_counter()
        out = sample(*a, **kw)
        sampled.append(time.perf_counter() - t)
        return out

    runner.sampler.sample = timed_sample
    threads_before = torch.get_num_threads()
    result = {"tokens": args.prompt_tokens, "server_args": server_args.quantization, "threads": {}}
    try:
        for threads in sorted({1, threads_before}):
            torch.set_num_threads(threads)
            walls, cpus = [], []
            sampled.clear()
            runner.set_request(0, SamplingParams(temperature=0.0), prompt, np.zeros(0, np.int32))
            with torch.inference_mode():
                for k in range(args.prefill_runs + 2):  # two warm-ups
                    t, c = time.perf_counter(), time.process_time()
                    runner.step([SeqInput(0, prompt, 0, pages, True)])
                    if k >= 2:
                        walls.append((time.perf_counter() - t) * 1e3)
                        cpus.append((time.process_time() - c) * 1e3)
            result["threads"][threads] = {
                "wall_p50_ms": statistics.median(walls),
                "wall_min_ms": min(walls),
                "cpu_p50_ms": statistics.median(cpus),
                "sample_p50_ms": statistics.median(sampled[2:]) * 1e3,
            }
    finally:
        torch.set_num_threads(threads_before)
        runner.pool.free(pages)
    return result


def ab(args, loop, tokenizer, out_dir: Path) -> dict:
    """Plain c=1 TTFT of the --base tree (A) against this one (B), requests alternating."""
    model = args.models[0]
    extra = shlex.split(args.real_args if model == "real" else "--null-model") + shlex.split(args.server_args)
    trees = {"a": Path(args.base).resolve(), "b": Path(".").resolve()}
    servers = {}
    ttft: dict[str, dict[str, list[float]]] = {side: {ep: [] for ep in ENDPOINTS} for side in trees}
    try:
        for side, tree in trees.items():
            servers[side] = sb.Server(extra, out_dir / f"ttft_ab_{side}.log", cwd=tree)
        for server in servers.values():
            server.wait_healthy()
        name = servers["a"].model_name()
        n = args.warmup + args.requests
        texts, _ = sb.make_prompts(tokenizer, n, args.prompt_tokens, 3)
        for i in range(n):
            for endpoint in ENDPOINTS:
                order = ("a", "b") if i % 2 == 0 else ("b", "a")
                for side in order:
                    payload = body(endpoint, name, texts[i], args.output_tokens)
                    r = loop.run_until_complete(one(servers[side], endpoint, payload, args.request_timeout))
                    if i >= args.warmup and not r.error and r.content_times:
                        ttft[side][endpoint].append((r.content_times[0] - r.start) * 1e3)
                    time.sleep(args.gap_ms / 1e3)
    finally:
        leftovers = {side: s.stop() for side, s in servers.items()}
    result = {"model": model, "server_args": extra, "trees": {k: str(v) for k, v in trees.items()}, "endpoints": {}}
    for endpoint in ENDPOINTS:
        a, b = ttft["a"][endpoint], ttft["b"][endpoint]
        result["endpoints"][endpoint] = {
            "a_p50_ms": statistics.median(a),
            "b_p50_ms": statistics.median(b),
            "a_p90_ms": pct(a, 0.9),
            "b_p90_ms": pct(b, 0.9),
            "b_over_a_p50": statistics.median(b) / statistics.median(a),
            "requests": min(len(a), len(b)),
        }
    result["leftovers"] = leftovers
    return result


def markdown(result: dict) -> str:
    fmt = report.fmt
    parts = []
    if result["models"]:
        parts.append(
            "Per stage: the median and p90 of its own time, and the median of when it ends after the client's "
            "send. A push wakes its consumer, which may run before the push returns (a negative wake); "
            "medians of stages with long tails need not add up to the median TTFT."
        )
    for model, m in result["models"].items():
        eps = m["endpoints"]
        rows = []
        for name, _, _ in STAGES:
            cells = [name]
            for ep in ENDPOINTS:
                st = eps[ep]["stages"].get(name)
                cells += [fmt(st and st[k], ".3f") for k in ("p50_ms", "p90_ms", "end_p50_ms")]
            rows.append(cells)
        rows.append(
            ["**sum of the stages' medians**"]
            + sum(([fmt(eps[ep]["sum_of_stage_p50_ms"], ".3f"), "", ""] for ep in ENDPOINTS), [])
        )
        rows.append(
            ["**TTFT (client)**"]
            + sum(
                ([fmt(eps[ep]["ttft_p50_ms"], ".3f"), fmt(eps[ep]["ttft_p90_ms"], ".3f"), ""] for ep in ENDPOINTS), []
            )
        )
        cols = ["stage"] + [f"{ep} {q}" for ep in ENDPOINTS for q in ("p50 ms", "p90 ms", "ends at (p50 ms)")]
        parts.append(
            f"### {model} model (`{shlex.join(m['server_args'])}`), "
            f"{eps['completions']['requests']} + {eps['chat']['requests']} requests, prompts of "
            f"{m['prompt_tokens_p50']['completions']:.0f} / {m['prompt_tokens_p50']['chat']:.0f} tokens\n\n"
            + report.table(cols, rows)
        )
        p = m.get("prefix_reuse")
        if p:
            parts.append(
                f"Prefix reuse, {p['prefix_tokens']}-token prefix, {p['pairs']} pairs: TTFT uncached p50 "
                f"{statistics.median(p['uncached_ttft_ms']):.1f} ms, "
                f"cached p50 {statistics.median(p['cached_ttft_ms']):.1f} ms "
                f"(ratio {p['ratio_p50']:.2f}); cached_tokens {p['cached_tokens']}."
            )
    if result.get("prefill"):
        p = result["prefill"]
        rows = [
            (
                t,
                fmt(v["wall_p50_ms"], ".2f"),
                fmt(v["wall_min_ms"], ".2f"),
                fmt(v["cpu_p50_ms"], ".2f"),
                fmt(v["sample_p50_ms"], ".3f"),
            )
            for t, v in p["threads"].items()
        ]
        parts.append(
            f"### The real model's prefill of {p['tokens']} tokens in one process "
            f"(`{p['server_args']}`), runner.step\n\n"
            + report.table(("threads", "wall p50 ms", "wall min ms", "CPU p50 ms", "of which sampling p50 ms"), rows)
        )
    if result.get("ab"):
        a = result["ab"]
        rows = [
            (
                ep,
                fmt(v["a_p50_ms"], ".3f"),
                fmt(v["b_p50_ms"], ".3f"),
                fmt(v["a_p90_ms"], ".3f"),
                fmt(v["b_p90_ms"], ".3f"),
                fmt(v["b_over_a_p50"], ".3f"),
                v["requests"],
            )
            for ep, v in a["endpoints"].items()
        ]
        parts.append(
            f"### A/B, plain c=1 TTFT ({a['model']} model), A `{a['trees']['a']}`, B `{a['trees']['b']}`\n\n"
            + report.table(("endpoint", "A p50 ms", "B p50 ms", "A p90 ms", "B p90 ms", "B / A p50", "requests"), rows)
        )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="null,real", help="null, real, or both (comma-separated)")
    ap.add_argument("--requests", type=int, default=100, help="requests per endpoint (the null model; --base)")
    ap.add_argument("--real-requests", type=int, default=20, help="requests per endpoint on the real model")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=sb.Workload.prompt_tokens)
    ap.add_argument("--output-tokens", type=int, default=sb.Workload.output_tokens)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="idle time between requests")
    ap.add_argument("--real-args", default=REAL_ARGS, help="`runtime serve` flags of the real model")
    ap.add_argument("--server-args", default="", help="more `runtime serve` flags for every server")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--prefix-pairs", type=int, default=5)
    ap.add_argument("--prefill-runs", type=int, default=20, help="in-process prefills of the real model (0: none)")
    ap.add_argument("--base", default=None, help="a code tree to A/B against this one (first of --models)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    report.add_arguments(ap, "ttft")
    args = ap.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    started = report.start(args, argv)
    tokenizer = sb.load_tokenizer(None)
    loop, _ = sb.new_event_loop()
    asyncio.set_event_loop(loop)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens, "models": {}}
    try:
        if args.base is not None:
            result["ab"] = ab(args, loop, tokenizer, args.out.parent)
        else:
            for model in args.models:
                result["models"][model] = run_model(model, args, loop, tokenizer, args.out.parent)
            if "real" in args.models and args.prefill_runs:
                result["prefill"] = prefill_forward(args)
    finally:
        sb.cancel_pending(loop)
        loop.close()
    md = markdown(result)
    print(md)
    report.write_results("ttft", result, md, started, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
