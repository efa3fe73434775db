"""The README's headline number, written from the committed result of perf/token_path.py: the
server CPU per streamed token with the defaults at 256 streams against the same server over
ZMQ + pickle, measured in one run. The README holds it between HEADLINE_START and
HEADLINE_END; tests/unit/test_headline.py checks that the two agree, so the sentence is never
copied by hand from a run nobody can trace.

    python -m perf.token_path          # measure (a clean tree: the result names its commit)
    python -m perf.headline --write    # rewrite the README's headline from it
    python -m perf.headline            # check: exit 1 when the README says something else
"""

from __future__ import annotations

import argparse
import json
import sys

from perf.report import RESULTS, ROOT

README = ROOT / "README.md"
RESULT = RESULTS / "token_path.json"
HEADLINE_START = "<!-- headline: perf/headline.py writes this from perf/results/token_path.json -->"
HEADLINE_END = "<!-- /headline -->"
STREAMS = 256


RATIO = "zmq+pickle / defaults, 256 streams"


def level(result: dict, config: str, streams: int) -> dict:
    for lv in result["levels"]:
        if lv["config"] == config and lv["concurrency"] == streams:
            return lv
    raise LookupError(f"{RESULT.name} has no level of {streams} streams for {config!r}")


def headline(result: dict) -> str:
    """The sentence, from a token_path result holding the defaults and zmq+pickle at STREAMS."""
    ring = level(result, "defaults", STREAMS)["server_cpu_us_per_token"]
    zmq = level(result, "zmq+pickle", STREAMS)["server_cpu_us_per_token"]
    ratio = result["ratios"][RATIO]["median"]
    run = result["run"]
    machine = run["machine"]
    return (
        f"with the null model (instant tokens) at {STREAMS} concurrent streams it spent {ring:.1f} µs of CPU "
        f"per streamed token, {ratio:.1f}x less than the same server over ZMQ + pickle ({zmq:.1f} µs; medians "
        f"of {result['rounds']} interleaved rounds on a {machine['logical_cores']}-core {machine['cpu']} machine "
        f"at commit `{run['commit']}`; [perf/results/token_path.md](perf/results/token_path.md): where each µs "
        "goes, by process and stage)."
    )


def readme_headline(text: str) -> str:
    """What the README holds between the markers, on one line."""
    start = text.index(HEADLINE_START) + len(HEADLINE_START)
    return " ".join(text[start : text.index(HEADLINE_END, start)].split())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the README's headline")
    args = ap.parse_args(argv)
    want = headline(json.loads(RESULT.read_text()))
    text = README.read_text()
    if args.write:
        start = text.index(HEADLINE_START) + len(HEADLINE_START)
        end = text.index(HEADLINE_END, start)
        README.write_text(text[:start] + "\n" + want + "\n" + text[end:])
        return 0
    if readme_headline(text) != want:
        print(f"README.md's headline differs from {RESULT}:\n  README: {readme_headline(text)}\n  result: {want}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
