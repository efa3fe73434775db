"""The whole server for real: `granian --interface asgi runtime.app:app` with one worker and
an API key, the default model, driven with the official openai client and httpx.

Greedy outputs equal the OfflineEngine's for the same prompts (runtime/offline.py); usage,
stop strings, n, logprobs; the bad-request table over HTTP; a client that leaves frees its
request's KV pages; kill -9 of the scheduler fails every open stream within 2 s and the
server answers 503 from then on; SIGINT stops every process and leaves no shared memory.
The tests of this module run in order and share one server (the last two end it)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from bad_requests import API_KEY, BAD_REQUESTS, MODEL

from protocol.sampling_params import SamplingParams

MAX_TOKENS = 10
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = "Here is a long shared preamble about the history of the city of Paris. " * 6  # > 2 KV pages
AUTH = {"authorization": f"Bearer {API_KEY}"}
BEAM = {"max_tokens": 4}  # a beam search's step is a request per beam


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        api_key=API_KEY,
        log_level="warning",
        max_total_tokens=32768,
        max_running_requests=16,
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(API_KEY, timeout=120)


@pytest.fixture(scope="module")
def want(offline_engine):
    """The OfflineEngine's greedy outputs: PROMPTS, PROMPTS[0] with logprobs, and CHAT."""
    engine = offline_engine
    outs = engine.generate([*PROMPTS, PROMPTS[0]], [greedy(), greedy(), greedy(logprobs=True, top_logprobs=2)])
    (chat,) = engine.chat(CHAT, greedy())
    return {"completions": outs[:2], "logprobs": outs[2], "chat": chat}


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS, **kw)


def stop_word(want) -> str:
    return want["completions"][0].text.split()[1]  # the second word: it ends the text early


def pretokenized_chats(client, chat: dict) -> list[tuple[list[int], object, list]]:
    """vLLM's pre-tokenized chat: the chat's prompt ids sent with other messages, in vLLM's two
    spellings, whole and streamed."""
    ids = client.chat.completions.create(extra_body={"return_token_ids": True}, **chat).model_extra["prompt_token_ids"]
    other = {**chat, "messages": [{"role": "user", "content": "unrelated text"}]}
    answers = []
    for spelling in ({"prompt_token_ids": ids}, {"kv_transfer_params": {"prompt_token_ids": ids}}):
        extra = {**spelling, "return_token_ids": True}
        whole = client.chat.completions.create(extra_body=extra, **other)
        answers.append((ids, whole, list(client.chat.completions.create(stream=True, extra_body=extra, **other))))
    return answers


@pytest.fixture(scope="module")
def got(server, client, want):
    """Every output test's requests, sent at once so that the scheduler runs them as one batch."""
    stop = stop_word(want)
    completion = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0)
    chat = dict(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    calls = {
        "completions": lambda: client.completions.create(prompt=PROMPTS, **completion),
        "completions_stream": lambda: list(client.completions.create(prompt=PROMPTS, stream=True, **completion)),
        "chat": lambda: client.chat.completions.create(**chat),
        "chat_stream": lambda: list(
            client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat)
        ),
        "chat_stream_continuous": lambda: list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, n=2, **chat
            )
        ),
        "completions_stream_continuous": lambda: list(
            client.completions.create(
                prompt=PROMPTS[0],
                stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True},
                **completion,
            )
        ),
        "token_ids": lambda: client.completions.create(
            prompt=PROMPTS, extra_body={"return_token_ids": True}, **completion
        ),
        "token_ids_stream": lambda: list(
            client.completions.create(
                prompt=PROMPTS[0], stream=True, extra_body={"return_token_ids": True}, **completion
            )
        ),
        "chat_token_ids": lambda: client.chat.completions.create(extra_body={"return_token_ids": True}, **chat),
        "chat_token_ids_stream": lambda: list(
            client.chat.completions.create(stream=True, extra_body={"return_token_ids": True}, **chat)
        ),
        "chat_pretokenized": lambda: pretokenized_chats(client, chat),
        "beam_one": lambda: client.completions.create(
            prompt=PROMPTS[0], extra_body={"use_beam_search": True}, **completion
        ),
        "beam_two": lambda: client.completions.create(
            prompt=PROMPTS, n=2, extra_body={"use_beam_search": True, "length_penalty": 0.5}, **(completion | BEAM)
        ),
        "beam_chat": lambda: client.chat.completions.create(n=2, extra_body={"use_beam_search": True}, **(chat | BEAM)),
        "beam_refused": lambda: [
            httpx.post(server.url(path), headers=AUTH, timeout=60, json={**body, "use_beam_search": True, "n": 2})
            for path, body in (
                ("/v1/completions", {**completion, "prompt": PROMPTS[0], "logprobs": 1}),
                ("/v1/completions", {**completion, "prompt": PROMPTS[0], "echo": True}),
                ("/v1/chat/completions", {**chat, "top_p": 0.5}),
                ("/v1/chat/completions", {**chat, "stop": ["x"]}),
            )
        ],
        "chat_echo": lambda: [
            (list if stream else lambda r: r)(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[*CHAT, {"role": "assistant", "content": "The capital"}],
                    max_tokens=4,
                    temperature=0,
                    stream=stream,
                    extra_body={"echo": True, "continue_final_message": True},
                )
            )
            for stream in (False, True)
        ],
        "stop": lambda: client.completions.create(prompt=PROMPTS[0], stop=[stop, "never appears"], **completion),
        "stop_stream": lambda: list(client.completions.create(prompt=PROMPTS[0], stop=stop, stream=True, **completion)),
        "stop_min_tokens": lambda: client.completions.create(
            prompt=PROMPTS[0], stop=stop, extra_body={"min_tokens": MAX_TOKENS}, **completion
        ),
        "stop_kept": lambda: client.completions.create(
            prompt=PROMPTS[0], stop=stop, extra_body={"include_stop_str_in_output": True}, **completion
        ),
        "generate_ids": lambda: httpx.post(
            server.url("/generate"),
            headers=AUTH,
            timeout=120,
            json={"text": PROMPTS[0], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}},
        ).json(),
        "generate_ids_stream": lambda: [
            json.loads(line[6:])
            for line in httpx.post(
                server.url("/generate"),
                headers=AUTH,
                timeout=120,
                json={
                    "text": PROMPTS[0],
                    "stream": True,
                    "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0},
                },
            ).text.split("\n\n")
            if line.startswith("data: {")
        ],
        "stop_generate": lambda: httpx.post(
            server.url("/generate"),
            headers=AUTH,
            timeout=120,
            json={
                "text": PROMPTS[0],
                "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0, "stop": stop},
            },
        ).json(),
        "n2": lambda: client.completions.create(prompt=PROMPTS[0], n=2, **completion),
        "n2_sampled": lambda: list(
            client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4, n=2, temperature=1.0, seed=7, stream=True
            )
        ),
        **{
            name: (
                lambda n=n: client.completions.create(
                    model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=1234, n=n
                )
            )
            for name, n in (("seeded_n3", 3), ("seeded_n3_again", 3), ("seeded_n1", 1))
        },
        "logprobs": lambda: client.completions.create(prompt=PROMPTS[0], logprobs=2, **completion),
        "chat_logprobs": lambda: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
        ),
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: f.result() for name, f in futures.items()}


def scrape(server) -> dict[str, float]:
    """/metrics as {name{labels}: value}, the model_name label left out."""
    text = httpx.get(server.url("/metrics"), headers=AUTH, timeout=30).text
    return {
        re.sub(r'\{model_name="[^"]*"\}|model_name="[^"]*",?', "", line.rsplit(" ", 1)[0]): float(
            line.rsplit(" ", 1)[1]
        )
        for line in text.splitlines()
        if line.startswith(("ringserve_", "sglang:"))
    }


def engine_metrics(server) -> dict[str, float]:
    return {name: value for name, value in scrape(server).items() if "{" not in name}


# ---------------------------------------------------------------- outputs


def test_completions_equal_the_offline_engine(got, want):
    want = want["completions"]
    resp = got["completions"]
    assert [c.text for c in resp.choices] == [w.text for w in want]
    assert [c.finish_reason for c in resp.choices] == [w.finish_reason for w in want]
    assert resp.usage.prompt_tokens == sum(w.prompt_tokens for w in want)
    assert resp.usage.completion_tokens == sum(w.completion_tokens for w in want)
    streamed, finish = ["", ""], [None, None]
    for chunk in got["completions_stream"]:
        for c in chunk.choices:
            streamed[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert streamed == [w.text for w in want]
    assert finish == [w.finish_reason for w in want]


def test_chat_equals_the_offline_engine(got, want):
    want = want["chat"]
    resp = got["chat"]
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].finish_reason == want.finish_reason
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
    chunks = got["chat_stream"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.completion_tokens
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens


def test_generate_output_ids(got, want):
    """SGLang's /generate answers output_ids: the generated token ids, so far in each stream event."""
    ids = want["completions"][0].token_ids
    assert got["generate_ids"]["output_ids"] == ids
    events = got["generate_ids_stream"]
    assert events[-1]["output_ids"] == ids and events[-1]["text"] == want["completions"][0].text
    assert all(ids[: len(e["output_ids"])] == e["output_ids"] for e in events)


def test_return_token_ids(got, want, tokenizer):
    """vLLM's return_token_ids: each completion choice's prompt_token_ids and token_ids (a chat
    answer's prompt ids at its top level); streamed, the prompt's on the first chunk and each
    chunk's own new ids."""
    resp = got["token_ids"]
    for choice, prompt, expected in zip(resp.choices, PROMPTS, want["completions"]):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == tokenizer(prompt)["input_ids"] and extra["token_ids"] == expected.token_ids
    chunks = [c.choices[0].model_extra for c in got["token_ids_stream"] if c.choices]
    assert chunks[0]["prompt_token_ids"] == tokenizer(PROMPTS[0])["input_ids"]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == want["completions"][0].token_ids
    chat = got["chat_token_ids"]
    assert chat.model_extra["prompt_token_ids"] and chat.choices[0].model_extra["token_ids"] == want["chat"].token_ids
    stream = got["chat_token_ids_stream"]
    assert stream[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    ids = [t for c in stream if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    assert ids == want["chat"].token_ids


def test_pretokenized_chat_uses_the_ids_not_the_messages(got, want):
    """vLLM's prompt_token_ids (and kv_transfer_params' older spelling): the ids are the prompt,
    verbatim; the request's own messages are not rendered."""
    for ids, whole, stream in got["chat_pretokenized"]:
        assert whole.model_extra["prompt_token_ids"] == ids and whole.usage.prompt_tokens == len(ids)
        assert whole.choices[0].message.content == want["chat"].text
        assert stream[0].model_extra["prompt_token_ids"] == ids
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want["chat"].text


def test_beam_search(got, want):
    """vLLM's use_beam_search: one beam is greedy decoding; n beams are n different answers a
    prompt, best first; what beam search would ignore is a 400 naming it."""
    assert got["beam_one"].choices[0].text == want["completions"][0].text
    two = got["beam_two"].choices
    assert [c.index for c in two] == [0, 1, 2, 3] and all(c.finish_reason in ("stop", "length") for c in two)
    assert two[0].text != two[1].text and two[2].text != two[3].text
    assert got["beam_two"].usage.completion_tokens <= 4 * BEAM["max_tokens"]
    chat = got["beam_chat"].choices
    assert len(chat) == 2 and chat[0].message.content != chat[1].message.content
    refused = [(r.status_code, r.json()["error"]["param"]) for r in got["beam_refused"]]
    assert refused == [(400, "logprobs"), (400, "echo"), (400, "top_p"), (400, "stop")]


def test_chat_echo(got):
    """vLLM's chat echo with a continued final message: the answer starts with that message."""
    whole, chunks = got["chat_echo"]
    text = whole.choices[0].message.content
    assert text.startswith("The capital") and len(text) > len("The capital")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_stop_strings(got, want):
    stop = stop_word(want)
    text = want["completions"][0].text
    cut = text[: text.index(stop)]
    assert (got["stop"].choices[0].text, got["stop"].choices[0].finish_reason) == (cut, "stop")
    assert "".join(c.choices[0].text for c in got["stop_stream"]) == cut
    assert got["stop_stream"][-1].choices[0].finish_reason == "stop"
    assert got["stop_generate"]["text"] == cut
    assert got["stop_generate"]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # SGLang's matched_stop on OpenAI choices: the stop string that ended it, on the finishing chunk
    assert got["stop"].choices[0].model_extra["matched_stop"] == stop
    assert got["stop_stream"][-1].choices[0].model_extra["matched_stop"] == stop
    assert all("matched_stop" not in c.choices[0].model_extra for c in got["stop_stream"][:-1])
    assert got["completions"].choices[0].model_extra["matched_stop"] is None  # length
    eos = {c.model_extra["matched_stop"] for c in got["chat"].choices if c.finish_reason == "stop"}
    assert all(isinstance(m, int) for m in eos)  # the model's end-of-turn token id
    (last,) = [c.choices[0] for c in got["chat_stream"] if c.choices and c.choices[0].finish_reason]
    assert last.model_extra["matched_stop"] == got["chat"].choices[0].model_extra["matched_stop"]
    # include_stop_str_in_output (vLLM's; SGLang's no_stop_trim): the match stays in the text
    assert (got["stop_kept"].choices[0].text, got["stop_kept"].choices[0].finish_reason) == (cut + stop, "stop")
    # a stop string may not end in the text of the first min_tokens tokens: here, all of them
    assert want["completions"][0].finish_reason == "length"
    assert (got["stop_min_tokens"].choices[0].text, got["stop_min_tokens"].choices[0].finish_reason) == (text, "length")


def test_continuous_usage_stats(got, want):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries usage, its choice's
    completion tokens so far; the last chunk the whole request's."""
    for name, n in (("chat_stream_continuous", 2), ("completions_stream_continuous", 1)):
        chunks = got[name]
        assert all(c.usage is not None for c in chunks), name
        assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
        for i in range(n):
            mine = [c.usage.completion_tokens for c in chunks[:-1] if c.choices and c.choices[0].index == i]
            assert mine == sorted(mine) and mine[-1] <= MAX_TOKENS, (name, mine)
        final = chunks[-1]
        assert not final.choices and final.usage.completion_tokens == sum(
            max(c.usage.completion_tokens for c in chunks[:-1] if c.choices and c.choices[0].index == i)
            for i in range(n)
        )
    assert got["completions_stream_continuous"][-1].usage.completion_tokens == want["completions"][0].completion_tokens


def test_n_choices(got, want):
    (want,) = want["completions"][:1]
    resp = got["n2"]
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [want.text] * 2
    assert resp.usage.prompt_tokens == want.prompt_tokens  # the prompt counts once
    assert resp.usage.completion_tokens == 2 * want.completion_tokens
    assert {c.choices[0].index for c in got["n2_sampled"] if c.choices} == {0, 1}
    # seeded: choice j samples with seed + j (vLLM's rule): n different samples, reproducible
    texts = [c.text for c in got["seeded_n3"].choices]
    assert len(set(texts)) > 1, texts
    assert [c.text for c in got["seeded_n3_again"].choices] == texts
    assert got["seeded_n1"].choices[0].text == texts[0]


def test_logprobs(got, want):
    want = want["logprobs"]
    lp = got["logprobs"].choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == want.completion_tokens
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-3)
    for chosen, top, expected in zip(lp.token_logprobs, lp.top_logprobs, want.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-5)
        assert sorted(top.values()) == pytest.approx(sorted(expected.values()), abs=1e-3)
    chat = got["chat_logprobs"]
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


def test_cached_tokens_are_counted(server, client):
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < second.usage.prompt_tokens  # whole 16-token pages of the prompt


def test_batch_chat_answers_each_conversation_as_alone(server, client, want):
    """vLLM's /v1/chat/completions/batch: choice i is conversation i's answer, usage the sum."""
    other = [{"role": "user", "content": "Name a color."}]
    alone = client.chat.completions.create(model=MODEL, messages=other, max_tokens=MAX_TOKENS, temperature=0)
    body = {"model": MODEL, "messages": [CHAT, other, CHAT], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(server.url("/v1/chat/completions/batch"), json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["message"]["content"] for c in choices]
    assert texts == [want["chat"].text, alone.choices[0].message.content, want["chat"].text]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 2 * want["chat"].prompt_tokens + alone.usage.prompt_tokens
    for fields, param in (
        ({"stream": True}, "stream"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"n": 2}, "n"),
        ({"messages": [CHAT, [{"role": "user"}]]}, "messages[1][0].content"),
        ({"messages": CHAT}, "messages"),
    ):
        r = httpx.post(server.url("/v1/chat/completions/batch"), json={**body, **fields}, headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)


def test_allowed_token_ids_are_all_the_answer_holds(server, client, tokenizer):
    """vLLM's allowed_token_ids: greedy or sampled, every output token is one of them."""
    allowed = sorted({*tokenizer.encode(" Paris London Rome", add_special_tokens=False), tokenizer.eos_token_id})
    for temperature in (0.0, 1.0):
        r = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=8,
            temperature=temperature,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True},
        )
        assert r.choices[0].token_ids and set(r.choices[0].token_ids) <= set(allowed), r.choices[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"allowed_token_ids": [10**6]})
    assert e.value.body["param"] == "allowed_token_ids"
    with pytest.raises(openai.BadRequestError) as e:  # this server has no reasoning parser
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={"thinking_token_budget": 4}
        )
    assert e.value.body["param"] == "thinking_token_budget" and "--reasoning-parser" in e.value.body["message"]


def test_custom_roles_render_as_the_template_writes_them(server, client, tokenizer):
    """vLLM's: a role outside OpenAI's reaches the chat template (ChatML writes any role)."""
    messages = [{"role": "observer", "content": "It rains."}, *CHAT]
    r = httpx.post(server.url("/tokenize"), json={"messages": messages}, headers=AUTH, timeout=60)
    assert "<|im_start|>observer\nIt rains.<|im_end|>" in tokenizer.decode(r.json()["tokens"])
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert answer.choices[0].message.content


def test_invocations_serve_chat_and_completions_by_shape(server, want):
    """SageMaker's /invocations: a chat body is served as chat, a prompt as a completion."""
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(server.url("/invocations"), json=chat, headers=AUTH, timeout=120)
    assert r.json()["object"] == "chat.completion" and r.json()["choices"][0]["message"]["content"] == want["chat"].text
    prompt = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(server.url("/invocations"), json={**prompt, "stream": True}, headers=AUTH, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want["completions"][0].text
    r = httpx.post(server.url("/invocations"), json={"input": "x"}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert httpx.post(server.url("/invocations"), json=chat, timeout=60).status_code == 401  # the key still guards it


def test_native_routes(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).model_dump() == client.models.list().data[0].model_dump()
    assert client.models.retrieve(MODEL).model_extra["root"] == MODEL  # the model's name, not its files' place
    missing = httpx.get(server.url("/v1/models/not-" + MODEL), headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert missing.json()["error"]["param"] == "model"
    info = httpx.get(server.url("/get_model_info"), headers=AUTH).json()
    assert info["context_length"] == 8192 and info["vocab_size"] == 49152
    assert httpx.get(server.url("/get_server_info"), headers=AUTH).json()["max_total_num_tokens"] == 32768
    ids = httpx.post(server.url("/tokenize"), headers=AUTH, json={"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) == 2
    text = httpx.post(server.url("/detokenize"), headers=AUTH, json={"tokens": ids["tokens"]}).json()["text"]
    assert text == "Hello world"
    # SGLang's: special tokens skipped unless skip_special_tokens is false; /v1/ aliases
    chat = httpx.post(server.url("/v1/detokenize"), headers=AUTH, json={"tokens": [1, 4093, 198]}).json()["text"]
    assert chat == "user\n"
    kept = httpx.post(
        server.url("/detokenize"), headers=AUTH, json={"tokens": [1, 4093, 198], "skip_special_tokens": False}
    ).json()["text"]
    assert kept == "<|im_start|>user\n"
    messages = [{"role": "user", "content": "Hi"}]
    tokens = httpx.post(server.url("/v1/tokenize"), headers=AUTH, json={"messages": messages}).json()["tokens"]
    assert (
        len(tokens) == client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    )  # the chat template's ids
    assert (
        httpx.post(server.url("/detokenize"), headers=AUTH, json={"tokens": tokens, "skip_special_tokens": False})
        .json()["text"]
        .startswith("<|im_start|>")
    )
    # a string rid of a batch names its prompts <rid>_0, <rid>_1 (SGLang); e2e_latency once
    # finished; sampling_params one per prompt
    outs = httpx.put(
        server.url("/generate"),
        headers=AUTH,
        timeout=60,
        json={
            "text": ["Hi", "Hello"],
            "rid": "pair",
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2, "ignore_eos": True}],
        },
    ).json()
    assert [o["meta_info"]["id"] for o in outs] == ["pair_0", "pair_1"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1, 2]
    assert all(o["meta_info"]["e2e_latency"] > 0 for o in outs)
    echo = client.completions.create(model=MODEL, prompt=[1, 4093, 198], max_tokens=1, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("<|im_start|>user\n")
    assert httpx.post(server.url("/flush_cache"), headers=AUTH).status_code == 200
    # the key guards every route but the probes and the scrape, as SGLang's does
    assert httpx.get(server.url("/health_generate"), timeout=60).status_code == 200
    assert "ringserve_engine_up 1.0" in httpx.get(server.url("/metrics")).text
    assert httpx.get(server.url("/get_model_info")).status_code == 401


def test_unknown_paths_and_methods(server):
    """Routing errors in OpenAI's format: 404 for a path, 405 (with Allow) for a method."""
    resp = httpx.post(server.url("/v1/nothing"), headers=AUTH, json={})
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "POST /v1/nothing: Not Found"
    resp = httpx.get(server.url("/v1/chat/completions"), headers=AUTH)
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert httpx.head(server.url("/health")).status_code == 200  # HEAD where GET is served


def test_request_metrics(server, got, want):
    """The output tests' requests are counted (workers flush their counts every second)."""

    assert server.wait_until(lambda: scrape(server).get('ringserve_requests_total{endpoint="chat"}', 0) >= 4, 5)
    m = scrape(server)
    assert m['ringserve_requests_total{endpoint="completions"}'] >= 6
    assert m["sglang:time_to_first_token_seconds_count"] >= 15  # one per choice
    assert m["sglang:e2e_request_latency_seconds_count"] >= 15
    assert m["sglang:inter_token_latency_seconds_count"] > 0
    assert m["sglang:generation_tokens_total"] >= sum(w.completion_tokens for w in want["completions"])
    assert m["ringserve_engine_up"] == 1 and m["ringserve_kv_pages_total"] == 32768 // 16


def test_abort_request_by_rid(server):
    answer = {}

    def generate():
        answer["body"] = httpx.post(
            server.url("/generate"),
            headers=AUTH,
            timeout=60,
            json={
                "text": LONG_PROMPT,
                "rid": "to-abort",
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            },
        ).json()

    thread = threading.Thread(target=generate)
    thread.start()
    assert server.wait_until(lambda: engine_metrics(server)["sglang:num_running_reqs"] == 1, 30, interval=0.1)
    # a second request may not take the rid while the first holds it: the abort would miss one
    again = httpx.post(
        server.url("/generate"),
        headers=AUTH,
        timeout=60,
        json={"text": "Hi", "rid": "to-abort", "sampling_params": {"max_new_tokens": 2}},
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "rid", again.text
    assert httpx.post(server.url("/abort_request"), headers=AUTH, json={"rid": "to-abort"}).json() == {"aborted": 1}
    thread.join(30)
    assert answer["body"]["meta_info"]["finish_reason"] == {"type": "abort"}


def test_abort_request_by_rid_of_one_prompt_of_a_batch(server):
    """Each prompt of a /generate batch has its own rid: aborting one ends that prompt only, as
    it did when the abort came through another worker (before, the owning worker ended the batch)."""
    answer = {}

    def generate():
        answer["body"] = httpx.post(
            server.url("/generate"),
            headers=AUTH,
            timeout=300,
            json={
                "text": [LONG_PROMPT, LONG_PROMPT + " Again."],
                "rid": ["batch-a", "batch-b"],
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
            },
        ).json()

    thread = threading.Thread(target=generate)
    thread.start()
    assert server.wait_until(lambda: engine_metrics(server)["sglang:num_running_reqs"] == 2, 30, interval=0.1)
    assert httpx.post(server.url("/abort_request"), headers=AUTH, json={"rid": "batch-a"}).json() == {"aborted": 1}
    thread.join(300)  # the other prompt runs to its end: slow on a busy machine
    assert not thread.is_alive()
    assert [out["meta_info"]["finish_reason"]["type"] for out in answer["body"]] == ["abort", "length"]


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize("row", BAD_REQUESTS, ids=lambda r: r.name)
def test_bad_request(server, row):
    resp = httpx.post(server.url(row.path), content=row.body, headers=row.headers, timeout=60)
    assert resp.status_code == row.status, resp.text
    err = resp.json()["error"]
    assert err["param"] == row.param and err["message"], err


def test_healthy_after_bad_requests(server, client):
    assert httpx.get(server.url("/health")).status_code == 200
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert resp.usage.completion_tokens == 2


def test_detokenizer_is_a_batch_task_only_when_busy(server, client):
    """Busy, its wakeups (one a step) must not preempt the scheduler that woke it; with few
    requests open it is a normal task, so that a lone request's first token does not wait for
    a tick (runtime/detokenizer/process.py Pacing)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import os; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))"],
        capture_output=True,
    )
    if probe.returncode:
        pytest.skip(f"this machine refuses SCHED_BATCH: {probe.stderr.decode().strip()[-200:]}")
    detokenizer = server.engine["detokenizer"]
    assert os.sched_getscheduler(server.engine["scheduler"]) == os.SCHED_OTHER
    assert server.wait_until(lambda: os.sched_getscheduler(detokenizer) == os.SCHED_OTHER, 10, interval=0.1)
    seen = set()
    with ThreadPoolExecutor(12) as pool:
        streams = [
            pool.submit(
                lambda: list(
                    client.completions.create(
                        model=MODEL, prompt=PROMPTS[0], max_tokens=64, stream=True, extra_body={"ignore_eos": True}
                    )
                )
            )
            for _ in range(12)
        ]
        while not all(f.done() for f in streams) and os.SCHED_BATCH not in seen:
            seen.add(os.sched_getscheduler(detokenizer))
            time.sleep(0.01)
        for f in streams:
            f.result()
    assert os.SCHED_BATCH in seen
    assert server.wait_until(lambda: os.sched_getscheduler(detokenizer) == os.SCHED_OTHER, 10, interval=0.1)


# ---------------------------------------------------------------- clients that leave


def kv_idle(server) -> bool:
    m = engine_metrics(server)
    return m["sglang:num_running_reqs"] == 0 and m["sglang:num_queue_reqs"] == 0 and m["ringserve_kv_pages_used"] == 0


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_disconnect_frees_kv_pages(server, client, stream):
    assert server.wait_until(lambda: kv_idle(server), 30, interval=0.1)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=httpx.Timeout(60, read=None if stream else 1.0)) as http:
        if stream:
            with http.stream("POST", server.url("/v1/completions"), headers=AUTH, json=body) as resp:
                lines = resp.iter_lines()
                while not next(lines).startswith("data: {"):
                    pass
                m = engine_metrics(server)
                assert m["sglang:num_running_reqs"] == 1 and m["ringserve_kv_pages_used"] >= 3
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.url("/v1/completions"), headers=AUTH, json=body)
    assert server.wait_until(lambda: kv_idle(server), 10, interval=0.1), engine_metrics(server)


# ---------------------------------------------------------------- the engine dies: requests fail at once, 503 meanwhile


def test_scheduler_killed_mid_stream(server, client):
    ended: list[tuple[float, BaseException | None]] = []
    started = threading.Barrier(4)

    def stream():
        chunks = client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        error = None
        try:
            for i, _ in enumerate(chunks):
                if i == 1:
                    started.wait(60)
        except openai.APIError as e:
            error = e
        ended.append((time.monotonic(), error))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    started.wait(60)
    killed = time.monotonic()
    os.kill(server.engine["scheduler"], signal.SIGKILL)
    for t in threads:
        t.join(10)
    assert len(ended) == 3
    for at, error in ended:
        assert error is not None and "engine" in str(error)
        assert at - killed < 2.0
    health = httpx.get(server.url("/health"), timeout=5)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2)
    assert caught.value.status_code == 503 and time.monotonic() - t0 < 2.0


def test_sigint_stops_everything(server):
    server.stop(signal.SIGINT)
    assert server.proc.returncode == 0
    assert server.leftovers() == ([], [])
