"""Cost of building one SSE event (ns/event), ringserve's pre-encoded streams against the
usual way (a dict per chunk, all through orjson). Single thread, best of several repeats.

    python -m perf.sse_bench [--events 200000] [--repeats 5]
Prints a table; writes perf/results/sse.json and sse.md (perf/report.py)."""

from __future__ import annotations

import argparse
import time

import orjson

from httpapi.logprobs import LogprobVocab, TokenLogprobs
from httpapi.sse import ChatStream, CompletionStream
from perf import report

MODEL = "SmolLM2-135M-Instruct"
ID = "chatcmpl-0123456789abcdef0123456789abcdef"


def naive_chat_chunk(index: int, text: str, finish_reason: str | None) -> bytes:
    """What a server that builds a dict per chunk does (vLLM and SGLang build a pydantic model, slower still)."""
    return (
        b"data: "
        + orjson.dumps(
            {
                "id": ID,
                "object": "chat.completion.chunk",
                "created": 1700000000,
                "model": MODEL,
                "choices": [
                    {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
        )
        + b"\n\n"
    )


def ns_per_call(fn, events: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(events):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / events)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    report.add_arguments(ap, "sse")
    args = ap.parse_args()
    started = report.start(args)

    vocab = LogprobVocab([bytes([i]) for i in range(256)] + [b" word"] * 49152)
    chat = ChatStream(ID, 1700000000, MODEL, n_choices=4, vocab=vocab)
    completion = CompletionStream(ID, 1700000000, MODEL, n_choices=4, vocab=vocab)
    one_token = TokenLogprobs.of([300], [-0.5])
    one_token_top5 = TokenLogprobs.of([300], [-0.5], [[300, 301, 302, 303, 304]], [[-0.5, -1, -2, -3, -4]])
    coalesced = " word" * 8
    cases = {
        "naive dict + orjson (1 token)": lambda: naive_chat_chunk(2, " word", None),
        "chat delta (1 token)": lambda: chat.delta(2, " word"),
        "chat delta (8 tokens coalesced)": lambda: chat.delta(2, coalesced),
        "chat delta with finish_reason": lambda: chat.delta(2, " word", "stop"),
        "completion delta (1 token)": lambda: completion.delta(2, " word"),
        "chat delta + logprobs (1 token)": lambda: chat.delta(2, " word", None, one_token),
        "chat delta + logprobs (1 token, top 5)": lambda: chat.delta(2, " word", None, one_token_top5),
        "completion delta + logprobs (1 token, top 5)": lambda: completion.delta(2, " word", None, one_token_top5),
    }
    results = {
        name: ns_per_call(fn, args.events if "logprobs" not in name else args.events // 10, args.repeats)
        for name, fn in cases.items()
    }
    assert chat.delta(2, " word") == naive_chat_chunk(2, " word", None)  # same bytes, cheaper

    width = max(map(len, results))
    print(f"{'event':<{width}}  ns/event")
    for name, ns in results.items():
        print(f"{name:<{width}}  {ns:8.0f}")
    md = report.table(("event", "ns/event"), [(name, f"{ns:.0f}") for name, ns in results.items()])
    md += (
        f"\n\nBest of {args.repeats} repeats of {args.events} events ({args.events // 10} with logprobs), "
        f"one thread; orjson {orjson.__version__}."
    )
    paths = report.write_results(
        "sse",
        {
            "unit": "ns/event",
            "events": args.events,
            "repeats": args.repeats,
            "orjson": orjson.__version__,
            "results": results,
        },
        md,
        started,
        out=args.out,
    )
    print("wrote " + " and ".join(map(str, paths)))


if __name__ == "__main__":
    main()
