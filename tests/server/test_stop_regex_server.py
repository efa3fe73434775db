"""SGLang's stop_regex on the OpenAI routes, against a null-model server (whose answers are a
fixed sentence: gpu/null_model.py SENTENCE): a choice stops where a pattern matches its text,
cut at the match's end, with finish_reason "stop" and the pattern as matched_stop; streamed or
not, each of n choices on its own; the generation stops in the engine too."""

from __future__ import annotations

import httpx
import pytest
from bad_requests import MODEL

from gpu.null_model import SENTENCE

HI = [{"role": "user", "content": "Hi"}]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(start_server.Server.granian, workers=1, null_model=True, log_level="warning")


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL, "max_tokens": MAX_TOKENS, **body}, timeout=60)


def through(pattern_end: str) -> str:
    """The null model's sentence up to and including the first `pattern_end`."""
    return SENTENCE[: SENTENCE.index(pattern_end) + len(pattern_end)]


def test_a_completion_stops_at_the_first_match_of_any_pattern(server):
    body = post(server, "/v1/completions", {"prompt": "Hi", "stop_regex": ["dog", "f[aeiou]x"], "n": 2}).json()
    for choice in body["choices"]:
        assert choice["text"] == through("fox")
        assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "f[aeiou]x"


def test_the_engine_stops_generating_at_the_match(server):
    """The scheduler is told: a long answer ends soon after its match, not at max_tokens."""
    body = post(server, "/v1/completions", {"prompt": "Hi", "stop_regex": "fox", "max_tokens": 1500}).json()
    assert body["choices"][0]["text"] == through("fox")
    assert body["usage"]["completion_tokens"] < 1500


def test_a_streamed_chat_stops_at_the_match(server):
    with httpx.stream(
        "POST",
        server.url("/v1/chat/completions"),
        json={"model": MODEL, "max_tokens": MAX_TOKENS, "messages": HI, "stream": True, "stop_regex": r"l\w+y"},
        timeout=60,
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [httpx.Response(200, content=line[6:]).json() for line in lines]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == through("lazy")
    last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(last) == 1 and last[0]["finish_reason"] == "stop" and last[0]["matched_stop"] == r"l\w+y"


def test_no_match_runs_to_its_length(server):
    choice = post(server, "/v1/chat/completions", {"messages": HI, "stop_regex": "qqq", "max_tokens": 5}).json()
    assert choice["choices"][0]["finish_reason"] == "length" and choice["choices"][0]["matched_stop"] is None


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hi", "stop_regex": "("}),
        ("/v1/completions", {"prompt": "Hi", "stop_regex": ["a"] * 17}),
        ("/v1/chat/completions", {"messages": HI, "stop_regex": ""}),
        ("/v1/chat/completions", {"messages": HI, "stop_regex": 5}),
        ("/v1/chat/completions/batch", {"messages": [HI], "stop_regex": "a"}),
        ("/v1/responses", {"input": "Hi", "stop_regex": "a"}),
    ],
)
def test_refusals_name_stop_regex(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_regex", r.text
