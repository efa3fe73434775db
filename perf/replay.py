"""Replays a request dump (--dump-requests-folder) against a server and compares outputs.

Each dumped request is sent again to the server's /generate as its prompts' token ids (a
chat's after its template, as dumped) with its sampling parameters and n; each choice's raw
text and finish reason are compared with the dumped ones where the output is determined:
greedy or seeded requests that ended by themselves (stop or length). Unseeded sampled
requests, and those that were aborted or failed, are sent but not compared. A request whose
parameters /generate cannot carry (vLLM's allowed_token_ids, a thinking budget, a LoRA
adapter) is not sent: altered, its output would differ for no fault of the server's; the
results count them by reason.

    python -m perf.replay --dump /var/dumps --url http://127.0.0.1:30000   # RINGSERVE_API_KEY: its key

Prints a table; writes perf/results/replay.json and replay.md (perf/report.py)."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson

from perf import report
from protocol.sampling_params import GREEDY_TEMPERATURE, GrammarKind

# SamplingParams' fields that /generate's sampling_params names otherwise
_RENAMED = {"seed": "sampling_seed"}
_SENT = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "stop_token_ids",
    "no_stop_trim",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
_GRAMMAR_FIELD = {
    GrammarKind.JSON_SCHEMA: "json_schema",
    GrammarKind.REGEX: "regex",
    GrammarKind.EBNF: "ebnf",
    GrammarKind.STRUCTURAL_TAG: "structural_tag",
}
_SETTLED = ("stop", "length")  # finishes a replay must reproduce; abort and error depend on the moment
# SamplingParams' fields /generate has no way to send, and the value that means "unused"
_UNSENDABLE: dict[str, Any] = {"allowed_token_ids": [], "thinking_budget": -1, "lora_id": 0}


def dumped_requests(path: Path) -> Iterator[dict[str, Any]]:
    """The dump's requests, oldest file first: a folder's requests-w*.jsonl (rotated files first), or one file."""
    files = [path] if path.is_file() else sorted(path.glob("requests-w*.jsonl"), key=_oldest_first)
    for file in files:
        for line in file.read_bytes().splitlines():
            if line.strip():
                yield orjson.loads(line)


def _oldest_first(file: Path) -> tuple[str, bool]:
    worker = file.name.split(".")[0]
    return worker, not file.name.endswith(".1.jsonl")


def generate_body(request: dict[str, Any]) -> dict[str, Any]:
    """/generate's body for a dumped request: every prompt, each with its own sampling_params."""
    params = []
    for p in request["sampling_params"]:
        sp = {_RENAMED.get(k, k): p[k] for k in _SENT if p[k] is not None}
        if p["grammar_kind"]:
            sp[_GRAMMAR_FIELD[GrammarKind(p["grammar_kind"])]] = p["grammar"]
        if p["logit_bias"]:
            sp["logit_bias"] = {str(token): bias for token, bias in p["logit_bias"]}
        sp["n"] = request["n"]
        params.append(sp)
    return {"input_ids": request["prompts"], "sampling_params": params}


def unsendable(request: dict[str, Any]) -> str | None:
    """The first field of the request's parameters that /generate cannot carry, or None."""
    for p in request["sampling_params"]:
        for name, unused in _UNSENDABLE.items():
            if p.get(name, unused) != unused:
                return name
    return None


def determined(params: dict[str, Any]) -> bool:
    """The output is a function of the request: greedy, or seeded."""
    return params["temperature"] < GREEDY_TEMPERATURE or params["top_k"] == 1 or params["seed"] is not None


def replay_one(http: httpx.Client, request: dict[str, Any]) -> dict[str, Any]:
    field = unsendable(request)
    if field is not None:
        return {"status": None, "unsent": field, "seconds": 0.0, "compared": 0, "equal": 0}
    t0 = time.perf_counter()
    r = http.post("/generate", json=generate_body(request))
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.text[:500], "seconds": seconds, "compared": 0, "equal": 0}
    outputs = r.json()
    choices_per_prompt = len(request["outputs"]) // len(request["prompts"])
    compared = equal = 0
    diffs = []
    for i, (old, new) in enumerate(zip(request["outputs"], outputs)):
        if not determined(request["sampling_params"][i // choices_per_prompt]) or old["finish_reason"] not in _SETTLED:
            continue
        compared += 1
        finish = (new["meta_info"]["finish_reason"] or {}).get("type")
        if new["text"] == old["text"] and finish == old["finish_reason"]:
            equal += 1
        else:
            diffs.append({"choice": i, "dumped": old["text"][:200], "replayed": new["text"][:200], "finish": finish})
    return {"status": 200, "seconds": seconds, "compared": compared, "equal": equal, "diffs": diffs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, required=True, help="a --dump-requests-folder, or one of its files")
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at once")
    ap.add_argument("--limit", type=int, default=None, help="replay the first this many requests")
    ap.add_argument("--timeout", type=float, default=600.0)
    report.add_arguments(ap, "replay")
    args = ap.parse_args(argv)
    started = report.start(args, argv)

    requests = list(dumped_requests(args.dump))[: args.limit]
    key = os.environ.get("RINGSERVE_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=args.timeout) as http:
        with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
            results = list(pool.map(lambda req: replay_one(http, req), requests))

    by_endpoint: dict[str, dict[str, float]] = {}
    for req, res in zip(requests, results):
        row = by_endpoint.setdefault(
            req["endpoint"], {"requests": 0, "unsent": 0, "failed": 0, "compared": 0, "equal": 0, "s": 0.0}
        )
        row["requests"] += 1
        row["unsent"] += res["status"] is None
        row["failed"] += res["status"] not in (None, 200)
        row["compared"] += res["compared"]
        row["equal"] += res["equal"]
        row["s"] += res["seconds"]
    columns = ("endpoint", "requests", "not sent", "failed", "choices compared", "equal", "mean s")
    rows = [
        (
            name,
            r["requests"],
            r["unsent"],
            r["failed"],
            r["compared"],
            r["equal"],
            report.fmt(r["s"] / max(1, r["requests"] - r["unsent"]), ".3f"),
        )
        for name, r in sorted(by_endpoint.items())
    ]
    md = report.table(columns, rows)
    compared, equal = sum(r["compared"] for r in results), sum(r["equal"] for r in results)
    failed = sum(r["status"] not in (None, 200) for r in results)
    unsent: dict[str, int] = {}
    for r in results:
        if r["status"] is None:
            unsent[r["unsent"]] = unsent.get(r["unsent"], 0) + 1
    md += (
        f"\n\n{len(requests)} dumped requests from `{args.dump.name}` replayed to /generate at concurrency "
        f"{args.concurrency}: {equal} of {compared} determined choices (greedy or seeded, ended by stop or length) "
        f"equal to the dump, {failed} requests failed."
    )
    if unsent:
        md += " Not sent (a field /generate cannot carry): " + ", ".join(f"{n} with {k}" for k, n in unsent.items())
    print(md)
    report.write_results(
        "replay",
        {
            "dump": str(args.dump),
            "requests": len(requests),
            "failed": failed,
            "not_sent": unsent,
            "compared": compared,
            "equal": equal,
            "by_endpoint": by_endpoint,
            "mismatches": [{"request": i, **d} for i, res in enumerate(results) for d in res.get("diffs", ())][:50],
        },
        md,
        started,
        out=args.out,
    )
    return 0 if failed == 0 and equal == compared else 1


if __name__ == "__main__":
    raise SystemExit(main())
