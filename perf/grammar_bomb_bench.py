"""Grammar bombs against the token path: the latency of short unconstrained completions and of
/health while 8, then 64, pathological grammars are sent at once, against the same server idle.

Two kinds of bomb: a matching bomb, `(a{0,700}){0,700}a{30}b` (compiles in 10 ms; its mask fill grows
with each token: unbounded, its 20th token costs 20 s of the step loop), ended at its first token
over grammar.MAX_TOKEN_CPU_S; and compile bombs, `.{0,20000}` and variants (about 9 s of a core
each to compile), failed at --grammar-compile-timeout. Each round sends the bombs from threads,
then times `--probes` sequential unconstrained completions (16 tokens) and /health meanwhile.
The target: the unconstrained p50 within 1.5x of idle.

    python -m perf.grammar_bomb_bench               # bombs 8 and 64, 10 probes each
Writes perf/results/grammar_bomb.json and .md (perf/report.py), the server's log beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from perf import report
from perf import serving_bench as sb

MATCH_BOMB = "(a{0,700}){0,700}a{30}b"
COMPILE_BOMB = ".{0,20000}"
TARGET_RATIO = 1.5
COMPILE_TIMEOUT_S = 10.0


def completion(base: str, model: str, timeout: float = 600, **fields) -> tuple[int, float]:
    body = {"model": model, "prompt": "Say something:", "max_tokens": 16, "temperature": 0, **fields}
    start = time.monotonic()
    status = httpx.post(base + "/v1/completions", json=body, timeout=timeout).status_code
    return status, time.monotonic() - start


def probe(base: str, model: str, n: int) -> dict:
    """n sequential unconstrained completions, a /health after each: their latencies."""
    plain, health = [], []
    for _ in range(n):
        status, took = completion(base, model, timeout=300)
        plain.append(took if status == 200 else float("nan"))
        start = time.monotonic()
        httpx.get(base + "/health", timeout=60)
        health.append(time.monotonic() - start)
    return {
        "plain_p50_s": statistics.median(plain),
        "plain_max_s": max(plain),
        "health_max_s": max(health),
        "plain_s": plain,
    }


def under_bombs(base: str, model: str, kind: str, count: int, probes: int) -> dict:
    grammars = [MATCH_BOMB if kind == "match" else COMPILE_BOMB + "x" * i for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        start = time.monotonic()
        bombs = [
            pool.submit(completion, base, model, 600, guided_regex=g, prompt=f"A{i}:") for i, g in enumerate(grammars)
        ]
        time.sleep(0.5)
        out = probe(base, model, probes)
        statuses = [b.result()[0] for b in bombs]
        out["bombs_done_s"] = time.monotonic() - start
    out.update(kind=kind, bombs=count, bomb_statuses={str(s): statuses.count(s) for s in set(statuses)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bombs", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--probes", type=int, default=10)
    report.add_arguments(ap, "grammar_bomb")
    args = ap.parse_args(argv)
    started = report.start(args, argv)
    log = (args.out or report.RESULTS / "grammar_bomb.json").with_name("grammar_bomb_server.log")
    server = sb.Server(["--grammar-compile-timeout", str(COMPILE_TIMEOUT_S)], log)
    try:
        server.wait_healthy()
        model, base = server.model_name(), f"http://127.0.0.1:{server.port}"
        completion(base, model, guided_regex="[0-9]{3}")  # the grammar compiler is made
        idle = probe(base, model, args.probes)
        print(f"idle: p50 {idle['plain_p50_s']:.3f} s", flush=True)
        rounds = []
        for kind in ("match", "compile"):
            for count in args.bombs:
                r = under_bombs(base, model, kind, count, args.probes)
                r["ratio_to_idle"] = r["plain_p50_s"] / idle["plain_p50_s"]
                rounds.append(r)
                print(
                    f"{count} {kind} bombs: p50 {r['plain_p50_s']:.3f} s (x{r['ratio_to_idle']:.2f}), "
                    f"max {r['plain_max_s']:.2f} s, /health max {r['health_max_s']:.3f} s, bombs {r['bomb_statuses']}",
                    flush=True,
                )
    finally:
        server.stop()
    result = {"idle": idle, "rounds": rounds, "target_ratio": TARGET_RATIO, "compile_timeout_s": COMPILE_TIMEOUT_S}
    rows = [
        (
            r["kind"],
            r["bombs"],
            report.fmt(r["plain_p50_s"], ".3f"),
            report.fmt(r["ratio_to_idle"], ".2f"),
            report.fmt(r["plain_max_s"], ".2f"),
            report.fmt(r["health_max_s"], ".3f"),
            report.fmt(r["bombs_done_s"], ".1f"),
            r["bomb_statuses"],
        )
        for r in rounds
    ]
    md = (
        f"Idle unconstrained p50 {idle['plain_p50_s']:.3f} s (16 tokens), /health max {idle['health_max_s']:.3f} s.\n\n"
        + report.table(
            ("bomb", "count", "plain p50 s", "x idle", "plain max s", "/health max s", "bombs done s", "bomb statuses"),
            rows,
        )
    )
    paths = report.write_results("grammar_bomb", result, md, started, out=args.out)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
