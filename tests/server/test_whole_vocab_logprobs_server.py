"""vLLM's -1 logprobs (every token of the vocabulary) through a real server started with
`--max-logprobs -1`, against transformers on the same weights (fp32, CPU): chat's
top_logprobs -1 and prompt_logprobs -1 on completions; and the bounds: what --max-logprobs
does not allow, and requests whose alternatives in all pass MAX_LOGPROB_ENTRIES, are 400s
naming the field."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from bad_requests import MODEL

from gpu.models.reference import reference_model
from protocol.sampling_params import MAX_LOGPROB_ENTRIES

ATOL = 1e-3
VOCAB = 49152
CHAT = [{"role": "user", "content": "Name a colour."}]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        log_level="warning",
        quantization="none",  # the exact mode: compared with transformers
        max_total_tokens=4096,
        max_running_requests=4,
        max_logprobs=-1,
    )


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=300)


def ok(server, path: str, body: dict) -> dict:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def log_softmax(ids: list[int]) -> np.ndarray:
    """transformers' log-softmax [P, V]: row p predicts token p + 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            logits = reference_model()(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1).numpy()
    finally:
        torch.set_num_threads(threads)


def check_whole_row(got: dict[int, float], row: np.ndarray) -> None:
    """`got` (id -> logprob) holds every token, each at the reference's logprob."""
    assert len(got) == VOCAB
    ids = np.fromiter(got, np.int64, len(got))
    values = np.fromiter(got.values(), np.float64, len(got))
    floor = values > -9999.0  # -inf is reported as OpenAI's floor
    np.testing.assert_allclose(values[floor], row[ids[floor]], atol=ATOL)


def test_chat_top_logprobs_is_the_whole_vocabulary(server):
    body = ok(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": -1},
    )
    ids = ok(server, "/tokenize", {"model": MODEL, "messages": CHAT})["tokens"]
    (position,) = body["choices"][0]["logprobs"]["content"]
    top = position["top_logprobs"]
    assert len(top) == VOCAB
    values = [t["logprob"] for t in top]
    assert values == sorted(values, reverse=True)  # best first
    assert top[0]["token"] == position["token"]  # greedy: the sampled token is the likeliest
    row = log_softmax(ids)[-1]
    np.testing.assert_allclose(values, np.sort(row)[::-1], atol=ATOL)
    assert abs(np.logaddexp.reduce(np.array(values))) < 1e-3  # the whole distribution


def test_prompt_logprobs_is_the_whole_vocabulary(server):
    body = ok(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": -1})
    ids = ok(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})["tokens"]
    positions = body["choices"][0]["prompt_logprobs"]
    assert len(positions) == len(ids) and positions[0] is None
    reference = log_softmax(ids)
    for p in range(1, len(ids)):
        check_whole_row({int(k): v["logprob"] for k, v in positions[p].items()}, reference[p - 1])


def test_counts_past_the_vocabulary_are_refused(server):
    r = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": VOCAB + 1},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


@pytest.mark.parametrize(
    "body,param",
    [
        # the vocabulary at each of 100 positions
        ({"prompt": PROMPT, "max_tokens": 100, "logprobs": -1}, "logprobs"),
        # each choice within the bound, its choices together past it
        ({"prompt": "word " * 30, "max_tokens": 1, "prompt_logprobs": -1, "n": 2}, "n"),
    ],
)
def test_more_than_the_request_bound_is_refused(server, body, param):
    assert VOCAB * 100 > MAX_LOGPROB_ENTRIES and 2 * VOCAB * 30 > MAX_LOGPROB_ENTRIES > VOCAB * 31
    r = post(server, "/v1/completions", {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and str(MAX_LOGPROB_ENTRIES) in error["message"], error
