"""SSE event sequences, read back with the openai client's own types and stream parser."""

import httpx
import numpy as np
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from httpapi.errors import engine_unavailable
from httpapi.logprobs import LogprobVocab, TokenLogprobs
from httpapi.responses import Usage
from httpapi.sse import DONE, HEADERS, ChatStream, CompletionStream, GenerateStream, error_event, with_matched_stop

MODEL = "SmolLM2-135M-Instruct"
# a small real vocab: ids 0..255 are the bytes themselves, 256.. a few multi-byte tokens
VOCAB = LogprobVocab([bytes([i]) for i in range(256)] + ["é".encode(), " wörld".encode(), "🦙".encode()[:2]])


def events(stream_bytes: bytes) -> list[bytes]:
    """Split an SSE byte stream into the data of its events, checking the framing."""
    assert stream_bytes.endswith(b"\n\n")
    out = []
    for event in stream_bytes[:-2].split(b"\n\n"):
        assert event.startswith(b"data: ") and b"\n" not in event
        out.append(event[len(b"data: ") :])
    return out


def client_stream(chunks: list[bytes]) -> openai.OpenAI:
    handler = lambda request: httpx.Response(200, headers=HEADERS, content=iter(chunks))
    return openai.OpenAI(
        api_key="k",
        base_url="http://ringserve.test/v1",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )


def test_chat_stream_sequence():
    s = ChatStream("chatcmpl-9", 1700000000, MODEL, n_choices=2)
    body = b"".join(
        [
            s.start(),
            s.delta(0, "Hel"),
            s.delta(1, "Bon"),
            s.delta(0, 'lo, "world"\n', "stop"),
            s.delta(1, "jour 🦙", "length"),
            s.usage(Usage(12, 5, 4)),
            DONE,
        ]
    )
    data = events(body)
    assert data[-1] == b"[DONE]"
    chunks = [ChatCompletionChunk.model_validate(orjson.loads(d)) for d in data[:-1]]
    assert all(c.id == "chatcmpl-9" and c.model == MODEL and c.created == 1700000000 for c in chunks)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        text[choice.index] += choice.delta.content
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert text == {0: 'Hello, "world"\n', 1: "Bonjour 🦙"} and finish == {0: "stop", 1: "length"}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == 17
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 4


def test_openai_client_streams_chat_with_coalesced_logprobs():
    """One event carries three tokens (a client fell behind); the client sees all three."""
    s = ChatStream("chatcmpl-1", 1, MODEL, n_choices=1, vocab=VOCAB)
    lp = TokenLogprobs.of(
        [72, 256, 257], [-0.1, -0.2, -np.inf], [[72, 73], [256, 1], [257, 2]], [[-0.1, -3], [-0.2, -4], [-5, -6]]
    )
    chunks = [s.start(), s.delta(0, "Hé wörld", "stop", lp), s.usage(Usage(3, 3)), DONE]
    stream = client_stream(chunks).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        stream=True,
        logprobs=True,
        top_logprobs=2,
        stream_options={"include_usage": True},
    )
    got = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == "Hé wörld"
    content = got[1].choices[0].logprobs.content
    assert [t.token for t in content] == ["H", "é", " wörld"] and content[2].logprob == -9999.0
    assert [len(t.top_logprobs) for t in content] == [2, 2, 2] and content[1].bytes == list("é".encode())
    assert got[-1].usage.completion_tokens == 3


def test_completion_stream_text_offsets_continue_across_deltas():
    s = CompletionStream("cmpl-1", 1, MODEL, n_choices=1, vocab=VOCAB)
    first = s.delta(0, "Hé", None, TokenLogprobs.of([72, 256], [-1, -1]))
    second = s.delta(0, " wörld!", "length", TokenLogprobs.of([257, 33], [-1, -1]))
    # the client reads completion chunks as Completion without validating (finish_reason is null mid-stream)
    chunks = [construct_type(type_=Completion, value=orjson.loads(d)) for d in events(first + second)]
    assert [c.choices[0].logprobs.text_offset for c in chunks] == [[0, 1], [2, 8]]
    assert "".join(c.choices[0].text for c in chunks) == "Hé wörld!"
    assert chunks[1].choices[0].finish_reason == "length" and chunks[0].object == "text_completion"
    # text held back (a stop string's first bytes, a split character) moves no token's offset:
    # offsets follow the tokens' texts, as the non-streamed response has them
    s = CompletionStream("cmpl-1", 1, MODEL, n_choices=1, vocab=VOCAB)
    held = s.delta(0, "H", None, TokenLogprobs.of([72, 256], [-1, -1])) + s.delta(
        0, "é wörld!", "length", TokenLogprobs.of([257, 33], [-1, -1])
    )
    chunks = [construct_type(type_=Completion, value=orjson.loads(d)) for d in events(held)]
    assert [c.choices[0].logprobs.text_offset for c in chunks] == [[0, 1], [2, 8]]


def test_openai_client_streams_completions_and_ends_on_done():
    s = CompletionStream("cmpl-2", 1, MODEL, n_choices=2)
    chunks = [s.delta(1, "b"), s.delta(0, "a", "stop"), s.delta(1, "", "stop"), DONE, b'data: {"never": "read"}\n\n']
    got = list(client_stream(chunks).completions.create(model=MODEL, prompt="x", n=2, stream=True))
    assert [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in got] == [
        (1, "b", None),
        (0, "a", "stop"),
        (1, "", "stop"),
    ]


def test_error_mid_stream_reaches_the_client_as_an_error():
    s = ChatStream("chatcmpl-2", 1, MODEL, n_choices=1)
    err = engine_unavailable("the scheduler process died")
    chunks = [s.start(), s.delta(0, "Hel"), error_event(err), DONE]
    assert orjson.loads(events(error_event(err))[0]) == err.as_dict()
    got = []
    with pytest.raises(openai.APIError, match="scheduler process died"):
        for chunk in client_stream(chunks).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
        ):
            got.append(chunk)
    assert [c.choices[0].delta.content for c in got] == ["", "Hel"]


def test_generate_stream_is_cumulative_like_sglang():
    s = GenerateStream(["r0", "r1"], batch=True, vocab=VOCAB)
    out = [
        orjson.loads(d)
        for d in events(
            b"".join(
                [
                    s.delta(0, "He", Usage(3, 1)),
                    s.delta(1, "Yo", Usage(3, 1)),
                    s.delta(0, "llo", Usage(3, 2), "stop", matched_stop=2),
                ]
            )
        )
    ]
    assert [(o["index"], o["text"]) for o in out] == [(0, "He"), (1, "Yo"), (0, "Hello")]
    assert out[0]["meta_info"]["finish_reason"] is None
    assert out[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert out[2]["meta_info"]["id"] == "r0" and out[2]["meta_info"]["completion_tokens"] == 2
    single = GenerateStream(["r"], batch=False, vocab=VOCAB, return_text_in_logprobs=True)
    single.delta(0, "H", Usage(1, 1), logprobs=TokenLogprobs.of([72], [-0.5]))
    last = orjson.loads(
        events(single.delta(0, "é", Usage(1, 2), "length", logprobs=TokenLogprobs.of([256], [-0.25])))[0]
    )
    assert "index" not in last and last["text"] == "Hé"
    assert last["meta_info"]["output_token_logprobs"] == [[-0.5, 72, "H"], [-0.25, 256, "é"]]


@settings(max_examples=200, deadline=None)
@given(st.text(), st.sampled_from([None, "stop", "length", "abort"]), st.integers(0, 3))
def test_any_text_round_trips_through_one_event(text, finish_reason, index):
    chat = ChatStream("chatcmpl-x", 5, 'model "quoted" ✓', n_choices=4)
    completion = CompletionStream("cmpl-x", 5, "m", n_choices=4)
    for event, read in (
        (chat.delta(index, text, finish_reason), lambda c: c["delta"]["content"]),
        (completion.delta(index, text, finish_reason), lambda c: c["text"]),
    ):
        (data,) = events(event)
        (choice,) = orjson.loads(data)["choices"]
        assert (read(choice), choice["finish_reason"], choice["index"]) == (text, finish_reason, index)


def test_matched_stop_goes_beside_the_finish_reason_whatever_the_text():
    stream = ChatStream("chatcmpl-1", 1, "m", 1)
    tricky = 'say "finish_reason":"stop" and stop'  # its quotes are escaped in the event
    chunk = with_matched_stop(stream.delta(0, tricky, "stop"), "stop", "stop")
    choice = orjson.loads(chunk[len(b"data: ") :])["choices"][0]
    assert (choice["delta"]["content"], choice["finish_reason"], choice["matched_stop"]) == (tricky, "stop", "stop")
    tool = with_matched_stop(stream.event(0, {}, "tool_calls"), "tool_calls", 2)
    assert orjson.loads(tool[len(b"data: ") :])["choices"][0]["matched_stop"] == 2
    assert with_matched_stop(stream.delta(0, "x"), None, None) == stream.delta(0, "x")
    completion = CompletionStream("cmpl-1", 1, "m", 1)
    length = with_matched_stop(completion.delta(0, "y", "length"), "length", None)
    assert orjson.loads(length[len(b"data: ") :])["choices"][0]["matched_stop"] is None
