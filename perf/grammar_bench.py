"""What a grammar costs on the token path: serving_bench's streamed chat workload, each round
sent twice to one server, once unconstrained and once with a JSON-schema `response_format`,
in alternating order, so that both halves see the same spells of a noisy machine; the
median of the rounds' constrained / unconstrained ratios is the result.

Levels: the real model at concurrency 8 and 32, and the null model (instant tokens, so the
server's own per-token cost is what is measured) at 256 streams. The schema's `keywords` has
a minItems that takes an answer past --output-tokens, so a constrained answer runs to
max_tokens like the unconstrained one (ignore_eos): both halves stream as many tokens. Each request
of a round has a prompt of its own (nothing but the chat template's system prompt in the
prefix cache) and the constrained half uses the schema compiled in the warm-up. Measured
apart, in this process, with the scheduler's compiler settings: the cold and cached compile,
and the mask fill and accept a token costs, of the schema and of a bounded variant.

    python -m perf.grammar_bench                   # real c=8,32 and null c=256, 3 rounds
    python -m perf.grammar_bench --models null --rounds 5
Writes perf/results/grammar.json and grammar.md (perf/report.py), the servers' logs beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from json import JSONEncoder
from pathlib import Path

import orjson

from perf import report
from perf import serving_bench as sb

SCHEMA = {  # a typical extraction schema; keywords' minItems makes answers run to max_tokens
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string", "enum": ["fiction", "history", "science", "poetry"]}},
        "author": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
            "required": ["name"],
        },
        "keywords": {"type": "array", "items": {"type": "string"}, "minItems": 16},
    },
    "required": ["title", "year", "genres", "author", "keywords"],
}
# the same with bounds on its strings and numbers: xgrammar expands each length bound into its
# repetitions, which costs compile time and, at some states, mask time (measured apart)
BOUNDED_SCHEMA = {
    **SCHEMA,
    "properties": {
        **SCHEMA["properties"],
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 16},
    },
}
SAMPLE_ANSWER = {  # what the per-token costs are measured on
    "title": "The quick brown fox",
    "year": 1999,
    "genres": ["fiction", "poetry"],
    "author": {"name": "Alice Smith", "born": 1950},
    "keywords": "quick brown fox jumps over the lazy dog while the evening sun sets slowly behind hills".split(),
}
LEVELS = {"real": (8, 32), "null": (256,)}
TARGET_RATIO_C32 = 0.8  # a grammar may cost at most a fifth of the output tokens/s (real model, c=32)


def request_body(model: str, content: str, w: sb.Workload, constrained: bool) -> bytes:
    body = orjson.loads(sb.request_body(model, content, w))
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}
    return orjson.dumps(body)


def grammar_costs(rounds: int = 5) -> dict:
    """Per schema, for the default model's vocabulary: seconds to compile it cold (a new
    compiler, as a scheduler that has not seen it) and cached, and the µs a token costs on the
    scheduler's thread (one mask fill and one accept) over SAMPLE_ANSWER."""
    import xgrammar as xgr

    tokenizer = sb.load_tokenizer(None)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    out: dict = {"tokenizer_info_s": time.perf_counter() - t0}
    # spaced as the grammar writes JSON without any_whitespace: ", " and ": "
    answer_ids = tokenizer.encode(JSONEncoder().encode(SAMPLE_ANSWER), add_special_tokens=False)
    for name, schema in (("schema", SCHEMA), ("bounded_schema", BOUNDED_SCHEMA)):
        text = orjson.dumps(schema).decode()
        cold, cached = [], []
        for _ in range(rounds):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(text, any_whitespace=False)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiler.compile_json_schema(text, any_whitespace=False)
            cached.append(time.perf_counter() - t0)
        matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, len(tokenizer))
        fill = accept = 0.0
        for token in answer_ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            if not matcher.accept_token(token):
                raise RuntimeError(f"{name}: the sample answer does not match it")
            accept += time.perf_counter() - t1
            fill += t1 - t0
        out[name] = {
            "cold_s": statistics.median(cold),
            "cached_s": statistics.median(cached),
            "fill_us_per_token": fill / len(answer_ids) * 1e6,
            "accept_us_per_token": accept / len(answer_ids) * 1e6,
            "tokens": len(answer_ids),
        }
    return out


def run_model(model: str, levels: tuple[int, ...], args, loop, w: sb.Workload) -> dict:
    extra = ["--null-model"] if model == "null" else []
    server = sb.Server(extra, args.out.with_name(f"grammar_server_{model}.log"))
    run: dict = {"model": model, "server_args": extra, "levels": []}
    try:
        run["startup_s"] = server.wait_healthy()
        name = server.model_name()
        per_round = {c: args.requests or max(2 * c, 32) for c in levels}
        total = args.warmup + sum(2 * n * args.rounds for n in per_round.values())
        prompts, _ = sb.make_prompts(sb.load_tokenizer(None), total, w.prompt_tokens, w.seed)
        it = iter(prompts)
        warm = [request_body(name, next(it), w, constrained=k % 2 == 1) for k in range(args.warmup)]
        loop.run_until_complete(
            sb.run_closed_loop("127.0.0.1", server.port, warm, 4, args.request_timeout, lambda: None, lambda: None)
        )
        for c in levels:
            rounds = []
            for r in range(args.rounds):
                halves = {}
                order = ("plain", "json") if r % 2 == 0 else ("json", "plain")
                for half in order:
                    bodies = [request_body(name, next(it), w, half == "json") for _ in range(per_round[c])]
                    halves[half] = sb.measure_level(loop, server, bodies, c, w, args.request_timeout)
                rounds.append({"round": r, **halves})
                print(row_text(model, c, r, halves), flush=True)
            run["levels"].append({"concurrency": c, "requests": per_round[c], "rounds": rounds, **medians(rounds)})
    finally:
        sb.cancel_pending(loop)
        run["leftovers"] = server.stop()
    return run


def medians(rounds: list[dict]) -> dict:
    out = {}
    for key in ("output_throughput", "server_cpu_us_per_token"):
        ratios = [r["json"][key] / r["plain"][key] for r in rounds if r["plain"][key] and r["json"][key] is not None]
        out[f"median_ratio_{key}"] = statistics.median(ratios) if ratios else None
        for half in ("plain", "json"):
            values = [r[half][key] for r in rounds if r[half][key] is not None]
            out[f"median_{half}_{key}"] = statistics.median(values) if values else None
    out["failed"] = sum(r[h]["failed"] for r in rounds for h in ("plain", "json"))
    return out


def row_text(model: str, c: int, r: int, halves: dict) -> str:
    p, j = halves["plain"], halves["json"]
    return (
        f"{model} c={c} round {r}: tok/s plain {p['output_throughput']:.0f} json {j['output_throughput']:.0f} "
        f"(x{j['output_throughput'] / p['output_throughput']:.3f}); CPU µs/token plain "
        f"{report.fmt(p['server_cpu_us_per_token'])} json {report.fmt(j['server_cpu_us_per_token'])}; "
        f"failed {p['failed'] + j['failed']}"
    )


def markdown(result: dict) -> str:
    fmt = report.fmt
    rows = []
    for run in result["runs"]:
        for lv in run["levels"]:
            rows.append(
                (
                    run["model"],
                    lv["concurrency"],
                    len(lv["rounds"]),
                    fmt(lv["median_plain_output_throughput"], ".0f"),
                    fmt(lv["median_json_output_throughput"], ".0f"),
                    fmt(lv["median_ratio_output_throughput"], ".3f"),
                    fmt(lv["median_plain_server_cpu_us_per_token"], ".1f"),
                    fmt(lv["median_json_server_cpu_us_per_token"], ".1f"),
                    fmt(lv["median_ratio_server_cpu_us_per_token"], ".3f"),
                    lv["failed"],
                )
            )
    levels = report.table(
        (
            "model",
            "concurrency",
            "rounds",
            "plain tok/s",
            "json tok/s",
            "json / plain tok/s",
            "plain CPU µs/token",
            "json CPU µs/token",
            "json / plain CPU",
            "failed",
        ),
        rows,
    )
    costs = result["grammar_costs"]
    cost_table = report.table(
        ("schema", "cold compile ms", "cached compile µs", "mask fill µs/token", "accept µs/token"),
        [
            (
                name,
                fmt(c["cold_s"] * 1e3, ".1f"),
                fmt(c["cached_s"] * 1e6, ".0f"),
                fmt(c["fill_us_per_token"], ".1f"),
                fmt(c["accept_us_per_token"], ".1f"),
            )
            for name, c in ((n, costs[n]) for n in ("schema", "bounded_schema"))
        ],
    )
    cost_text = (
        f"On the scheduler's thread, per constrained token (one matcher, {costs['schema']['tokens']} tokens of a "
        f"sample answer; the tokenizer's xgrammar info is built once per scheduler in "
        f"{costs['tokenizer_info_s'] * 1e3:.0f} ms):\n\n{cost_table}"
    )
    target = result.get("target")
    target_line = (
        f"Target: the real model at concurrency 32 keeps at least {TARGET_RATIO_C32}x the unconstrained "
        f"output tokens/s with a JSON schema: measured {fmt(target['ratio'], '.3f')}x, "
        f"{'met' if target['met'] else 'NOT met'}."
        if target
        else ""
    )
    schemas = "\n\n".join(
        f"{name}:\n\n```json\n" + orjson.dumps(schema, option=orjson.OPT_INDENT_2).decode() + "\n```"
        for name, schema in (("schema (the serving rounds')", SCHEMA), ("bounded_schema", BOUNDED_SCHEMA))
    )
    return "\n\n".join(p for p in (target_line, levels, cost_text, schemas) if p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="real,null", help="comma list of: real, null")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=None, help="requests a half a round (default max(2 C, 32))")
    ap.add_argument("--warmup", type=int, default=8, help="requests before the first round, half of them JSON")
    ap.add_argument("--prompt-tokens", type=int, default=sb.Workload.prompt_tokens)
    ap.add_argument("--output-tokens", type=int, default=sb.Workload.output_tokens)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    report.add_arguments(ap, "grammar")
    args = ap.parse_args(argv)
    started = report.start(args, argv)
    models = sb.parse_list(args.models)
    if not models or not set(models) <= set(LEVELS):
        ap.error(f"--models must be a comma list of {', '.join(LEVELS)}")
    for name in ("rounds", "warmup", "output_tokens", "prompt_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    w = sb.Workload(args.prompt_tokens, args.output_tokens, 0.0, 0)
    args.out = Path(args.out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"workload": dataclasses.asdict(w), "schema": SCHEMA, "bounded_schema": BOUNDED_SCHEMA, "runs": []}
    result["grammar_costs"] = grammar_costs()
    loop, _ = sb.new_event_loop()
    try:
        for model in models:
            result["runs"].append(run_model(model, LEVELS[model], args, loop, w))
    finally:
        loop.close()
    for run in result["runs"]:
        for lv in run["levels"]:
            if run["model"] == "real" and lv["concurrency"] == 32:
                ratio = lv["median_ratio_output_throughput"]
                result["target"] = {"ratio": ratio, "met": ratio is not None and ratio >= TARGET_RATIO_C32}
    json_path, md_path = report.write_results("grammar", result, markdown(result), started, out=args.out)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
