"""Interleaved A/B of two servers: serving_bench's workload sent to each in turn, round after
round, both up at once, so that both see the same spells of a machine whose speed moves (this
VM's, by up to 2x within minutes: single runs of one build differ more than most changes).
Reports each round's server CPU per streamed token (and per process), requests/s, tokens
per SSE event and per step, and the median of the rounds' B / A ratios.

A side is a code tree (a git worktree of another commit, or this checkout: both run on this
Python's packages) and extra `python -m runtime serve` flags:

    git worktree add /tmp/base HEAD~3
    python -m perf.serving_ab --a /tmp/base --b .                  # null model, 256 streams
    python -m perf.serving_ab --b-args "--stream-interval 4"       # one tree, two settings
    python -m perf.serving_ab --model real --concurrency 32 --requests 96 --rounds 3 \\
        --a-args "--quantization gguf-q8" --b-args "--quantization gguf-q8"
Writes perf/results/serving_ab.json and serving_ab.md (perf/report.py), each server's log
beside them (not committed).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

from perf import report
from perf import serving_bench as sb

SIDES = ("a", "b")


def ratios(rounds: list[dict], key: str) -> list[float]:
    return [r["b"][key] / r["a"][key] for r in rounds if r["a"][key] and r["b"][key] is not None]


def markdown(result: dict) -> str:
    """The medians, the sides, and each round's levels."""
    fmt = report.fmt
    ratio = result["median_ratio"]
    summary = (
        f"{result['model']} model, concurrency {result['concurrency']}, {result['requests']} requests a side "
        f"a round; median of the rounds' B / A ratios: server CPU µs/token "
        f"{fmt(ratio.get('server_cpu_us_per_token'), '.3f')}, requests/s "
        f"{fmt(ratio.get('request_throughput'), '.3f')}; B lower in {result.get('lower_in', '-')} of "
        f"{len(result['rounds'])} rounds."
    )
    sides = report.table(
        ("side", "tree", "server args", "median server CPU µs/token"),
        [
            (
                side.upper(),
                f"`{s['tree']}`",
                f"`{shlex.join(s['server_args'])}`",
                fmt(s.get("median_cpu_us_per_token"), ".2f"),
            )
            for side, s in result["sides"].items()
        ],
    )
    rows = []
    for r in result["rounds"]:
        for side in SIDES:
            lv = r[side]
            rows.append(
                (
                    r["round"],
                    side.upper(),
                    fmt(lv["server_cpu_us_per_token"], ".2f"),
                    f"{lv['request_throughput']:.0f}",
                    fmt(lv["tokens_per_event"]),
                    fmt(lv["tokens_per_step"]),
                    lv["failed"],
                )
            )
    rounds = report.table(("round", "side", "server CPU µs/token", "req/s", "tok/event", "tok/step", "failed"), rows)
    return "\n\n".join([summary, sides, rounds])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for side in SIDES:
        ap.add_argument(f"--{side}", default=".", type=Path, help=f"side {side.upper()}'s code tree (default: .)")
        ap.add_argument(f"--{side}-args", default="", help=f"more `runtime serve` flags for side {side.upper()}")
    ap.add_argument("--model", choices=sb.MODELS, default="null")
    ap.add_argument("--concurrency", type=int, default=sb.TARGET_NULL_STREAMS)
    ap.add_argument("--requests", type=int, default=4096, help="requests a side a round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=64, help="requests a side before the first round")
    ap.add_argument("--prompt-tokens", type=int, default=sb.Workload.prompt_tokens)
    ap.add_argument("--output-tokens", type=int, default=sb.Workload.output_tokens)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    report.add_arguments(ap, "serving_ab")  # the servers' logs go beside it too
    args = ap.parse_args(argv)
    started = report.start(args, argv)
    for name in ("concurrency", "requests", "rounds", "output_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    w = sb.Workload(args.prompt_tokens, args.output_tokens, 0.0, 0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers: dict[str, sb.Server] = {}
    result = {
        "model": args.model,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "sides": {},
        "rounds": [],
        "median_ratio": {},
        "leftovers": {},
    }
    loop = None
    try:
        for side in SIDES:
            extra = [
                "--transport",
                "ring",
                *(["--null-model"] if args.model == "null" else []),
                *shlex.split(getattr(args, f"{side}_args")),
            ]
            tree = getattr(args, side).resolve()
            servers[side] = sb.Server(extra, args.out.with_name(f"serving_ab_{side}.log"), cwd=tree)
            result["sides"][side] = {"tree": str(tree), "server_args": extra}
        for server in servers.values():
            server.wait_healthy()
        prompts, _ = sb.make_prompts(
            sb.load_tokenizer(None), args.warmup + args.rounds * args.requests, args.prompt_tokens, 0
        )
        loop, _ = sb.new_event_loop()
        bodies = {side: [sb.request_body(s.model_name(), p, w) for p in prompts] for side, s in servers.items()}
        for side, server in servers.items():
            if args.warmup:
                loop.run_until_complete(
                    sb.run_closed_loop(
                        "127.0.0.1",
                        server.port,
                        bodies[side][: args.warmup],
                        min(args.warmup, 8),
                        args.request_timeout,
                        lambda: None,
                        lambda: None,
                    )
                )
        for r in range(args.rounds):
            at = args.warmup + r * args.requests
            levels = {}
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:  # each goes first every other round
                levels[side] = lv = sb.measure_level(
                    loop,
                    servers[side],
                    bodies[side][at : at + args.requests],
                    args.concurrency,
                    w,
                    args.request_timeout,
                )
                per_process = {
                    k.split("::")[-1]: round(v / lv["output_tokens"] * 1e6, 2)
                    for k, v in lv["server_cpu_by_process_s"].items()
                    if v and lv["output_tokens"]
                }
                print(
                    f"round {r} {side.upper()}: {lv['server_cpu_us_per_token'] or 0:.1f} µs/token "
                    f"{lv['request_throughput']:.0f} req/s {lv['tokens_per_event'] or 0:.1f} tok/event "
                    f"{lv['tokens_per_step'] or 0:.1f} tok/step failed={lv['failed']} {per_process}",
                    flush=True,
                )
            result["rounds"].append({"round": r, **levels})
        for key in ("server_cpu_us_per_token", "request_throughput"):
            rs = ratios(result["rounds"], key)
            result["median_ratio"][key] = statistics.median(rs) if rs else None
        result["lower_in"] = sum(x < 1 for x in ratios(result["rounds"], "server_cpu_us_per_token"))
        for side in SIDES:
            values = [r[side]["server_cpu_us_per_token"] for r in result["rounds"]]
            result["sides"][side]["median_cpu_us_per_token"] = statistics.median(values)
        print(
            f"server CPU µs/token, median: A {result['sides']['a']['median_cpu_us_per_token']:.2f}, "
            f"B {result['sides']['b']['median_cpu_us_per_token']:.2f}; B/A median ratio "
            f"{result['median_ratio']['server_cpu_us_per_token']:.3f}, B lower in {result['lower_in']} of "
            f"{args.rounds} rounds; requests/s B/A {result['median_ratio']['request_throughput']:.3f}",
            flush=True,
        )
    finally:
        if loop is not None:
            sb.cancel_pending(loop)
            loop.close()
        for side, server in servers.items():
            result["leftovers"][side] = server.stop()
        report.write_results("serving_ab", result, markdown(result), started, out=args.out)
    failed = sum(r[s]["failed"] for r in result["rounds"] for s in SIDES)
    left = [v for v in result["leftovers"].values() if v["processes"] or v["shm_segments"] or v["engine_files"]]
    return 1 if failed or left else 0


if __name__ == "__main__":
    sys.exit(main())
