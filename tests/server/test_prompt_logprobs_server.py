"""Prompt logprobs through a real server (`granian ... runtime.app:app` on the default model),
against transformers on the same weights (fp32, CPU): OpenAI completions' echo with logprobs
(streamed and not), vLLM's prompt_logprobs on completions and on chat, SGLang's /generate
input_token_logprobs and input_top_logprobs, from position 0 and from a logprob_start_len.
Every request of the module is sent at once (one server, short prompts, few tokens)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from bad_requests import MODEL

from gpu.models.reference import reference_model

ATOL = 1e-3
K = 2  # alternatives asked for
MAX_TOKENS = 3
PROMPT = "The capital of France is Paris, and the capital of Italy is"
OTHER = "def fibonacci(n):"
CHAT = [{"role": "user", "content": "Name a colour."}]
START = 4  # logprob_start_len
PINNED = [1000, 100, 5000]  # logprob_token_ids, none of them likely
SAMPLED = 42  # the one token the pinned chat may take (allowed_token_ids)
AS_IDS = {"return_tokens_as_token_ids": True}
TOOL = {
    "type": "function",
    "function": {
        "name": "colour",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        log_level="warning",
        quantization="none",  # the exact mode: compared with transformers
        max_total_tokens=8192,
        max_running_requests=16,
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=120)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url(path), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def got(server, client):
    """Every request of the module, sent at once: the scheduler runs them in the same steps."""
    completion = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0)
    calls = {
        "echo": lambda: client.completions.create(prompt=[PROMPT, OTHER], echo=True, logprobs=K, **completion),
        "echo0": lambda: client.completions.create(prompt=PROMPT, echo=True, logprobs=0, **completion),
        "echo_stream": lambda: list(
            client.completions.create(prompt=[PROMPT, OTHER], echo=True, logprobs=K, stream=True, **completion)
        ),
        "vllm": lambda: client.completions.create(prompt=OTHER, extra_body={"prompt_logprobs": K}, **completion),
        "vllm_stream": lambda: list(
            client.completions.create(prompt=OTHER, stream=True, extra_body={"prompt_logprobs": K}, **completion)
        ),
        "chat": lambda: client.chat.completions.create(messages=CHAT, extra_body={"prompt_logprobs": K}, **completion),
        "chat_stream": lambda: list(
            client.chat.completions.create(messages=CHAT, stream=True, extra_body={"prompt_logprobs": K}, **completion)
        ),
        # a forced tool call: the stream's text is parsed into delta objects (routes.chat_events)
        "chat_tools_stream": lambda: list(
            client.chat.completions.create(
                messages=CHAT,
                tools=[TOOL],
                tool_choice="required",
                stream=True,
                extra_body={"prompt_logprobs": K},
                **completion,
            )
        ),
        # vLLM's logprob_token_ids: these ids' logprobs (and the sampled one's), not the likeliest
        "pinned": lambda: client.chat.completions.create(
            messages=CHAT,
            logprobs=True,
            top_logprobs=5,
            extra_body={**AS_IDS, "logprob_token_ids": PINNED, "allowed_token_ids": [SAMPLED]},
            **{**completion, "max_tokens": 1},
        ),
        "pinned_stream": lambda: list(
            client.completions.create(
                prompt=OTHER, logprobs=5, stream=True, extra_body={**AS_IDS, "logprob_token_ids": PINNED}, **completion
            )
        ),
        "generate": lambda: post(
            server,
            "/generate",
            {
                "text": PROMPT,
                "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": K,
                "return_text_in_logprobs": True,
            },
        ),
        "generate_start": lambda: post(
            server,
            "/generate",
            {
                "text": OTHER,
                "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
                "return_logprob": True,
                "logprob_start_len": START,
            },
        ),
        "ids": lambda: {
            "prompt": post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})["tokens"],
            "other": post(server, "/tokenize", {"model": MODEL, "prompt": OTHER})["tokens"],
            "chat": post(server, "/tokenize", {"model": MODEL, "messages": CHAT})["tokens"],
            "chat_tools": post(server, "/tokenize", {"model": MODEL, "messages": CHAT, "tools": [TOOL]})["tokens"],
        },
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.fixture(scope="module")
def reference(got):
    """prompt name -> (ids, transformers' log-softmax [P, V]: row p predicts token p + 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = reference_model()
        out = {}
        with torch.inference_mode():
            for name, ids in got["ids"].items():
                logits = model(torch.tensor([ids])).logits[0].float()
                out[name] = (ids, torch.log_softmax(logits, dim=-1).numpy())
        return out
    finally:
        torch.set_num_threads(threads)


def check_top(top: dict[int, float], row: np.ndarray) -> None:
    """`top` (id -> logprob) is `row`'s K likeliest: ties within the tolerance may swap."""
    assert len(top) == K
    want = np.sort(row)[::-1][:K]
    np.testing.assert_allclose(sorted(top.values(), reverse=True), want, atol=ATOL)
    np.testing.assert_allclose(row[list(top)], list(top.values()), atol=ATOL)


def check_rank(rank: int, row: np.ndarray, token: int) -> None:
    x = row[token]
    assert (row > x + ATOL).sum() + 1 <= rank <= (row >= x - ATOL).sum()


# ---------------------------------------------------------------- completions: echo + logprobs


def check_echo(choice, reference, tokenizer) -> None:
    name, prompt = [("prompt", PROMPT), ("other", OTHER)][choice.index]
    ids, ref = reference[name]
    P = len(ids)
    lp = choice.logprobs
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == P + MAX_TOKENS
    assert "".join(lp.tokens[:P]) == prompt
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    text_id = {tokenizer.convert_tokens_to_string([t]): i for i, t in enumerate(vocab)}
    for j in range(1, P):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1][ids[j]]), abs=ATOL), j
        top = {text_id[t]: y for t, y in lp.top_logprobs[j].items()}
        assert ids[j] in top and len(top) in (K, K + 1), "the K likeliest and the prompt's own token"
        np.testing.assert_allclose(ref[j - 1][list(top)], list(top.values()), atol=ATOL)
        check_top(dict(sorted(top.items(), key=lambda kv: -kv[1])[:K]), ref[j - 1])
    # the completion's first token is predicted by the prompt's last position
    first = text_id[lp.tokens[P]]
    assert lp.token_logprobs[P] == pytest.approx(float(ref[P - 1][first]), abs=ATOL)
    assert all(len(t) == K for t in lp.top_logprobs[P:])
    # offsets: from 0, each token's text after the previous, continuing into the completion
    assert lp.text_offset[0] == 0 and lp.text_offset[P] == len(prompt)
    for a, b, token in zip(lp.text_offset, lp.text_offset[1:], lp.tokens):
        assert b == a + len(token)


def test_completions_echo_with_logprobs(got, reference, tokenizer):
    choices = got["echo"].choices
    assert [c.index for c in choices] == [0, 1]
    for choice in choices:
        check_echo(choice, reference, tokenizer)


def test_completions_echo_with_logprobs_0_gives_each_tokens_own(got, reference, tokenizer):
    """logprobs 0 (vLLM's answer): each position's top_logprobs holds its own token alone."""
    ids, ref = reference["prompt"]
    lp = got["echo0"].choices[0].logprobs
    assert len(lp.top_logprobs) == len(ids) + MAX_TOKENS and lp.top_logprobs[0] is None
    for j, (token, x, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        if j:
            assert top == {token: x}, j
    assert lp.token_logprobs[1] == pytest.approx(float(ref[0][ids[1]]), abs=ATOL)


def test_completions_echo_with_logprobs_streamed(got, reference, tokenizer):
    chunks = got["echo_stream"]
    for whole in got["echo"].choices:
        mine = [c for chunk in chunks for c in chunk.choices if c.index == whole.index]
        name, prompt = [("prompt", PROMPT), ("other", OTHER)][whole.index]
        assert mine[0].text.startswith(prompt), "the choice's first chunk carries the echo"
        assert len(mine[0].logprobs.tokens) > len(reference[name][0]), "and the prompt's logprobs"
        text, tokens, lps, tops, offsets = "", [], [], [], []
        for c in mine:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
        assert text == whole.text
        assert tokens == whole.logprobs.tokens
        assert offsets == whole.logprobs.text_offset
        assert lps[0] is None and tops[0] is None
        np.testing.assert_allclose(lps[1:], whole.logprobs.token_logprobs[1:], atol=ATOL)
        for a, b in zip(tops[1:], whole.logprobs.top_logprobs[1:]):
            assert a.keys() == b.keys()
            np.testing.assert_allclose(list(a.values()), [b[t] for t in a], atol=ATOL)


def token_id(shown: str) -> int:
    assert shown.startswith("token_id:"), shown
    return int(shown.removeprefix("token_id:"))


def test_logprob_token_ids_give_those_ids_and_the_sampled_ones_logprobs(got, reference):
    content = got["pinned"].choices[0].logprobs.content
    assert len(content) == 1 and token_id(content[0].token) == SAMPLED
    top = {token_id(e.token): e.logprob for e in content[0].top_logprobs}
    assert len(top) == len(content[0].top_logprobs), "no token twice"
    assert list(top) == [*PINNED, SAMPLED]  # the client's order, then the sampled token
    row = reference["chat"][1][-1]  # the prompt's last position predicts the answer's first token
    np.testing.assert_allclose(list(top.values()), row[list(top)], atol=ATOL)
    assert content[0].logprob == pytest.approx(float(row[SAMPLED]), abs=ATOL)


def test_logprob_token_ids_streamed_on_completions(got, reference):
    logprobs = [c.logprobs for chunk in got["pinned_stream"] for c in chunk.choices if c.logprobs]
    positions = [top for lp in logprobs for top in lp.top_logprobs]
    tokens = [token for lp in logprobs for token in lp.tokens]
    assert len(positions) == len(tokens) == MAX_TOKENS
    for token, top in zip(tokens, positions):  # its own token first (vLLM's order), listed once
        assert [token_id(t) for t in top] == list(dict.fromkeys([token_id(token), *PINNED]))
    row = reference["other"][1][-1]
    first = {token_id(t): y for t, y in positions[0].items()}
    np.testing.assert_allclose(list(first.values()), row[list(first)], atol=ATOL)


# ---------------------------------------------------------------- vLLM's prompt_logprobs


def check_vllm(plp, ids: list[int], ref: np.ndarray, tokenizer) -> None:
    """vLLM's shape: an entry per prompt position, None first, {"<id>": {logprob, rank,
    decoded_token}} with the prompt token and the top K."""
    assert isinstance(plp, list) and len(plp) == len(ids)
    assert plp[0] is None
    for j in range(1, len(ids)):
        entry, row, t = plp[j], ref[j - 1], ids[j]
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        mine = entry[str(t)]
        assert mine["logprob"] == pytest.approx(float(row[t]), abs=ATOL), j
        assert mine["decoded_token"] == tokenizer.decode([t])
        check_rank(mine["rank"], row, t)
        top = {int(a): v for a, v in entry.items() if v["rank"] <= K}
        assert sorted(v["rank"] for v in top.values()) == list(range(1, K + 1))
        check_top({a: v["logprob"] for a, v in top.items()}, row)
        assert len(entry) == K + (mine["rank"] > K)
        for a, v in entry.items():
            assert v["decoded_token"] == tokenizer.decode([int(a)])


def same_vllm(a: list, b: list) -> None:
    """Two vLLM prompt_logprobs lists alike (logprobs within the tolerance: the requests may
    have run in different batches)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert x.keys() == y.keys()
        for t in x:
            assert (x[t]["rank"], x[t]["decoded_token"]) == (y[t]["rank"], y[t]["decoded_token"])
            assert x[t]["logprob"] == pytest.approx(y[t]["logprob"], abs=ATOL)


def test_vllm_prompt_logprobs_on_completions(got, reference, tokenizer):
    ids, ref = reference["other"]
    (choice,) = got["vllm"].choices
    assert choice.logprobs is None and not choice.text.startswith(OTHER)
    check_vllm(choice.prompt_logprobs, ids, ref, tokenizer)
    streamed = [c.model_extra.get("prompt_logprobs") for chunk in got["vllm_stream"] for c in chunk.choices]
    assert streamed[0] is not None and not any(streamed[1:]), "on the choice's first chunk only"
    same_vllm(streamed[0], choice.prompt_logprobs)
    assert "".join(c.text for chunk in got["vllm_stream"] for c in chunk.choices) == choice.text


def test_vllm_prompt_logprobs_on_chat(got, reference, tokenizer):
    ids, ref = reference["chat"]
    response = got["chat"]
    assert response.choices[0].logprobs is None
    check_vllm(response.prompt_logprobs, ids, ref, tokenizer)
    streamed = [chunk.model_extra.get("prompt_logprobs") for chunk in got["chat_stream"]]
    assert [s is not None for s in streamed].count(True) == 1
    same_vllm(next(s for s in streamed if s is not None), response.prompt_logprobs)
    text = "".join(c.delta.content or "" for chunk in got["chat_stream"] for c in chunk.choices)
    assert text == response.choices[0].message.content


def test_vllm_prompt_logprobs_on_a_parsed_chat_stream(got, reference, tokenizer):
    """A stream whose text is parsed into tool-call deltas carries them too, once."""
    ids, ref = reference["chat_tools"]
    assert ids != reference["chat"][0]  # the tool is in the prompt
    chunks = got["chat_tools_stream"]
    streamed = [chunk.model_extra.get("prompt_logprobs") for chunk in chunks]
    assert [s is not None for s in streamed].count(True) == 1
    check_vllm(next(s for s in streamed if s is not None), ids, ref, tokenizer)
    assert chunks[-1].choices[0].finish_reason is not None


# ---------------------------------------------------------------- SGLang's /generate


def test_generate_input_token_logprobs_from_0(got, reference, tokenizer):
    ids, ref = reference["prompt"]
    meta = got["generate"]["meta_info"]
    tokens, top = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(tokens) == len(top) == len(ids)
    assert [t[1] for t in tokens] == ids
    assert [t[2] for t in tokens] == [tokenizer.decode([t]) for t in ids]
    assert tokens[0][0] is None and top[0] is None
    for j in range(1, len(ids)):
        assert tokens[j][0] == pytest.approx(float(ref[j - 1][ids[j]]), abs=ATOL), j
        assert len(top[j]) == K and all(isinstance(e[2], str) for e in top[j])
        check_top({a: y for y, a, _ in top[j]}, ref[j - 1])
    # the output's logprobs as before: the first token predicted by the prompt's last position
    (y, first, _) = meta["output_token_logprobs"][0]
    assert y == pytest.approx(float(ref[-1][first]), abs=ATOL)
    assert meta["prompt_tokens"] == len(ids)


def test_generate_input_token_logprobs_from_a_start(got, reference):
    ids, ref = reference["other"]
    meta = got["generate_start"]["meta_info"]
    tokens = meta["input_token_logprobs"]
    assert "input_top_logprobs" not in meta or not any(meta["input_top_logprobs"][1:])
    assert len(tokens) == len(ids) - START
    assert [t[1] for t in tokens] == ids[START:]
    assert all(t[2] is None for t in tokens)  # return_text_in_logprobs false
    assert tokens[0][0] is None  # as SGLang: the first entry's logprob is null
    for j in range(START + 1, len(ids)):
        assert tokens[j - START][0] == pytest.approx(float(ref[j - 1][ids[j]]), abs=ATOL), j
