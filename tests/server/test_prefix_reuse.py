"""Prefix reuse over HTTP: the default model behind granian, the official openai client.

What the radix cache can reuse for a request is exact: the longest common prefix of its
prompt with the token ids a finished request left in the cache (its prompt and every output
token but the last, whose KV was never computed), cut to whole KV pages (16 tokens) and to the
prompt less its last token (always computed, it gives the first token's logits). Each request
here must report exactly that as usage.prompt_tokens_details.cached_tokens, /metrics'
`sglang:cached_tokens_total` (the workers' count of usage) and
`ringserve_engine_cached_tokens_total` (the scheduler's own) must rise by the same amount, the
scheduler's computed prompt tokens by the rest, and a request whose ~1000-token
prefix is cached must see its first token clearly sooner than one that computes it.
The tests share one server and run in order (each relies on what the previous ones cached)."""

from __future__ import annotations

import re
import statistics
import time

import httpx
import pytest
from bad_requests import API_KEY, MODEL

PAGE = 16
AUTH = {"authorization": f"Bearer {API_KEY}"}
SENTENCE = "Paragraph {k} of the shared preamble explains how the city of {city} grew along its river. "
CITIES = ("Paris", "Lyon", "Lille", "Nantes", "Rennes", "Dijon")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        api_key=API_KEY,
        log_level="warning",
        max_total_tokens=65536,  # nothing is evicted during the module
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(API_KEY, timeout=300)


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.url("/tokenize"), json={"model": MODEL, **body}, headers=AUTH, timeout=60)
    r.raise_for_status()
    return r.json()["tokens"]


def counters(server) -> dict[str, float]:
    """/metrics' prompt-token counters: the workers' (from usage) and the scheduler's own."""
    text = httpx.get(server.url("/metrics"), timeout=30).text
    out = {}
    for name in (
        "sglang:cached_tokens_total",
        "sglang:prompt_tokens_total",
        "ringserve_engine_cached_tokens_total",
        "ringserve_engine_prefill_tokens_total",
    ):
        found = re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)
        out[name] = float(found.group(2)) if found else 0.0
    return out


def rose_by(server, before: dict[str, float], cached: int, prompt: int) -> None:
    """Both cached-token counters rose by `cached`, the prompt tokens by `prompt`, and the
    scheduler computed the rest (its stats are published when it goes idle: waited for)."""
    want = {
        "sglang:cached_tokens_total": cached,
        "sglang:prompt_tokens_total": prompt,
        "ringserve_engine_cached_tokens_total": cached,
        "ringserve_engine_prefill_tokens_total": prompt - cached,
    }
    deadline = time.monotonic() + 10
    while True:
        now = counters(server)
        got = {k: now[k] - before[k] for k in want}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == want


def reusable(prompt: list[int], cached: list[int]) -> int:
    """The prompt tokens the radix cache can serve given `cached` (ids whose KV it holds)."""
    common = 0
    for a, b in zip(prompt, cached):
        if a != b:
            break
        common += 1
    return min(common, len(prompt) - 1) // PAGE * PAGE


def preamble(city: str, paragraphs: int) -> str:
    return "".join(SENTENCE.format(k=k, city=city) for k in range(paragraphs))


def first_token_s(client, prompt: list[int]) -> tuple[float, int]:
    """(seconds from the request to its first streamed token, cached_tokens of its usage)."""
    t0 = time.perf_counter()
    ttft, usage = None, None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None and usage is not None
    return ttft, usage.prompt_tokens_details.cached_tokens


def test_shared_prefix_counts(server, client):
    prefix = tokenize(server, prompt=preamble("Paris", 12))
    assert len(prefix) > 8 * PAGE
    first = prefix + tokenize(server, prompt=" Question one: when was it founded?")
    second = prefix + tokenize(server, prompt=" Question two: who lives there now?")
    before = counters(server)
    a = client.completions.create(model=MODEL, prompt=first, max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens == len(first)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = client.completions.create(model=MODEL, prompt=second, max_tokens=4, temperature=0)
    want = reusable(second, first)
    assert want >= len(prefix) // PAGE * PAGE - PAGE
    assert b.usage.prompt_tokens_details.cached_tokens == want
    again = client.completions.create(model=MODEL, prompt=second, max_tokens=4, temperature=0)
    # b left its prompt and its first three output tokens: the whole prompt but its last token is there
    want_again = reusable(second, second)
    assert again.usage.prompt_tokens_details.cached_tokens == want_again
    rose_by(server, before, want + want_again, len(first) + 2 * len(second))


def test_multi_turn_counts(server, client):
    messages = [
        {"role": "system", "content": preamble("Lyon", 6)},
        {"role": "user", "content": "Summarise the preamble in one sentence."},
    ]
    before = counters(server)
    total, prompts = 0, 0
    held: list[int] = []  # the ids whose KV the previous turn left in the cache
    for turn, question in enumerate(("Name one river.", "And one bridge?", "Thanks, anything else?")):
        prompt = tokenize(server, messages=messages)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        assert reply.usage.prompt_tokens == len(prompt)
        want = reusable(prompt, held)
        if turn:
            assert want >= len(held) // PAGE * PAGE - 2 * PAGE  # the previous turn's pages, bar the tail
        assert reply.usage.prompt_tokens_details.cached_tokens == want, f"turn {turn}"
        total += want
        prompts += len(prompt)
        answer = reply.choices[0].message.content
        output = tokenize(server, prompt=answer, add_special_tokens=False)
        if reply.choices[0].finish_reason == "stop":
            output = output + tokenize(server, prompt="<|im_end|>", add_special_tokens=False)
        held = (prompt + output)[:-1]
        messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    rose_by(server, before, total, prompts)


def test_cached_prefix_cuts_ttft(server, client):
    """Uncached and cached first tokens of ~1000-token prompts, in pairs, each pair a new prefix."""
    uncached, cached = [], []
    for city in CITIES[2:]:
        prefix = tokenize(server, prompt=preamble(city, 48))
        assert 900 <= len(prefix) <= 1200
        cold, n_cold = first_token_s(client, prefix + tokenize(server, prompt=" First, the river."))
        warm, n_warm = first_token_s(client, prefix + tokenize(server, prompt=" Second, the bridges."))
        assert n_cold == 0 and n_warm >= len(prefix) // PAGE * PAGE - PAGE
        uncached.append(cold)
        cached.append(warm)
    ratio = statistics.median(cached) / statistics.median(uncached)
    assert ratio < 0.7, f"cached TTFT {cached} vs uncached {uncached}"
