"""OpenAI's Responses API for real: `granian ... runtime.app:app` with two workers on the default
model (SmolLM2-135M), driven with the official openai client (client.responses).

Greedy answers are the same whole, streamed and in the background; a stream is the event stack
OpenAI's client assembles (its final response equals the whole one); max_output_tokens makes an
incomplete response; logprobs come one per output token; a stored response is found through
either worker (and previous_response_id through it continues the conversation exactly as the
explicit conversation would); store false keeps nothing; delete, cancel and input_items do what
OpenAI's do; forced tool calls and text.format answer valid JSON, and a call's output sent back
continues the conversation (a namespace's calls too, named apart); raw messages show the prompt
and output as the model saw them; bad requests are 4xx naming their field."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from bad_requests import MODEL

TOKENS = 16
CONTEXT = 2048  # small: truncation's over-long input prefills in seconds on a CPU
QUESTION = "Name ten colors."  # an answer longer than TOKENS: the responses are incomplete
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(start_server.Server.granian, workers=2, log_level="warning", context_length=CONTEXT)


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=300)


def create(client, **fields):
    return client.responses.create(model=MODEL, temperature=0, **{"max_output_tokens": TOKENS, **fields})


def by_worker(server) -> dict[str, httpx.Client]:
    """A keep-alive connection held by each worker (x-ringserve-worker names it), with the
    openai client's credential (a stored response is its maker's)."""
    held: dict[str, httpx.Client] = {}
    for _ in range(64):
        http = httpx.Client(base_url=server.url(""), timeout=60, headers={"authorization": "Bearer none"})
        worker = http.get("/v1/models").headers["x-ringserve-worker"]
        if worker in held:
            http.close()
        else:
            held[worker] = http
        if len(held) == 2:
            return held
    pytest.fail("every connection went to one worker")


def test_whole_and_streamed_answers_are_the_same(client):
    whole = create(client, input=QUESTION)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == TOKENS and whole.usage.total_tokens == whole.usage.input_tokens + TOKENS
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant" and whole.output_text
    events = list(create(client, input=QUESTION, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, TOKENS)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: from the prefix cache
    assert final.output[0].id == events[2].item.id


def test_logprobs_come_one_per_output_token(client):
    r = create(client, input=QUESTION, include=["message.output_text.logprobs"], top_logprobs=2)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text  # ascii answer: tokens are its text
    events = list(create(client, input=QUESTION, include=["message.output_text.logprobs"], top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(e.logprobs for e in deltas)  # every text delta carries its tokens' logprobs
    streamed = [lp for e in deltas for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    # the prompt comes from the prefix cache the second time: the same logits up to float rounding
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-3)


def test_a_stored_response_is_found_through_either_worker(server, client):
    first = create(client, input=[{"role": "user", "content": QUESTION}], instructions="Answer briefly.")
    workers = by_worker(server)
    output = first.model_dump(mode="json", exclude_unset=True)["output"]
    for http in workers.values():
        got = http.get(f"/v1/responses/{first.id}")
        assert got.status_code == 200 and got.json()["output"] == output
    with pytest.raises(openai.NotFoundError):  # another credential's request finds nothing
        server.openai_client(api_key="another-key").responses.retrieve(first.id)
    # previous_response_id continues the conversation as the explicit conversation would
    follow = "And three more?"
    chained = create(client, input=follow, previous_response_id=first.id, instructions="Answer briefly.")
    explicit = create(
        client,
        instructions="Answer briefly.",
        input=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow},
        ],
    )
    assert chained.output_text == explicit.output_text
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.previous_response_id == first.id
    # the chained response's input items: its own, then (older) the first's input and output
    items = client.responses.input_items.list(chained.id, order="asc", limit=100)
    assert [i.type for i in items.data] == ["message", "message", "message"]
    page = client.responses.input_items.list(chained.id, limit=1)
    assert len(page.data) == 1 and page.has_more and page.data[0].content[0].text == follow
    rest = client.responses.input_items.list(chained.id, limit=5, after=page.data[0].id)
    assert [i.id for i in rest.data] == [i.id for i in items.data[:2]][::-1] and not rest.has_more
    # deleted: gone for both workers
    assert client.responses.delete(first.id) is None
    for http in workers.values():
        assert http.get(f"/v1/responses/{first.id}").status_code == 404
        http.close()


def test_store_false_keeps_nothing(client):
    r = create(client, input=QUESTION, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        create(client, input="More.", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def wait_for(client, response_id: str, statuses: tuple[str, ...], timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.responses.retrieve(response_id)
        if r.status in statuses:
            return r
        time.sleep(0.1)
    pytest.fail(f"{response_id} stayed {r.status}")


def test_background_responses_run_and_cancel(client):
    whole = create(client, input=QUESTION)
    queued = create(client, input=QUESTION, background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = wait_for(client, queued.id, ("completed", "incomplete"))
    assert done.output_text == whole.output_text
    long = create(client, input="Write a long story about the sea.", background=True, max_output_tokens=1000)
    wait_for(client, long.id, ("in_progress",))
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(1)  # the engine's abort and the runner's end: neither undoes the cancel
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(done.id).status == done.status  # an ended one: returned as it is
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(whole.id)  # a synchronous one


def test_forced_calls_stream_and_their_outputs_continue_the_conversation(client):
    ask = "What is the weather like in Paris today?"
    named = {"type": "function", "name": "get_weather"}
    whole = create(client, input=ask, tools=[WEATHER], tool_choice=named, max_output_tokens=64)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and whole.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(create(client, input=ask, tools=[WEATHER], tool_choice=named, max_output_tokens=64, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments
    answer = create(
        client,
        previous_response_id=whole.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
    )
    assert answer.output[0].type == "message" and answer.output_text
    required = create(client, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=64)
    assert {item.type for item in required.output} == {"function_call"}
    cut = create(client, input=ask, tools=[WEATHER], tool_choice="required", max_output_tokens=6)
    assert cut.incomplete_details.reason == "max_output_tokens"  # no call is complete in 6 tokens: none is
    assert all(item.type != "function_call" for item in cut.output) and not cut.output_text


def test_a_namespaces_calls_name_it_and_raw_messages_show_what_the_model_read(client):
    """vLLM's namespace tools: the model is shown "<namespace>__<name>", the call items carry the
    two apart (whole and streamed) and a call sent back continues the conversation; vLLM's
    enable_response_messages: the prompt's text and ids as the model read them, and the raw
    output's (its forced JSON, which no item shows as text)."""
    weather = {"type": "namespace", "name": "weather", "description": "Weather tools", "tools": [WEATHER]}
    ask, raw = "What is the weather like in Paris today?", {"enable_response_messages": True}
    fields = {"input": ask, "tools": [weather], "max_output_tokens": 64, "extra_body": raw}
    whole = create(client, tool_choice={"type": "function", "name": "get_weather"}, **fields)
    (call,) = whole.output
    assert (call.type, call.name, call.namespace) == ("function_call", "get_weather", "weather")
    (shown,) = whole.input_messages
    assert shown["type"] == "raw_message_tokens" and '"name": "weather__get_weather"' in shown["message"]
    assert len(shown["tokens"]) == whole.usage.input_tokens
    (said,) = whole.output_messages
    assert json.loads(said["message"]) == json.loads(call.arguments)
    assert len(said["tokens"]) == whole.usage.output_tokens
    events = list(create(client, tool_choice="required", stream=True, **fields))
    calls = [e.item for e in events if e.type.startswith("response.output_item.") and e.item.type == "function_call"]
    assert calls and all((c.name, c.namespace) == ("get_weather", "weather") for c in calls)
    (streamed_said,) = events[-1].response.output_messages
    assert streamed_said["message"].startswith('[{"name": "weather__get_weather"')
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    answer = create(client, previous_response_id=whole.id, tools=[weather], input=[output])
    assert answer.output[0].type == "message" and answer.output_text


def test_text_format_json_schema_validates(client):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    r = create(client, input="Describe a person.", text={"format": fmt}, max_output_tokens=64)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_truncation_auto_drops_the_oldest_turns(server, client):
    """An input over the context: a 400 naming it, unless truncation "auto" drops the oldest
    turns (whole: a user's message and what follows it) until it fits."""
    long_turns = []
    for i in range(20):
        long_turns += [
            {"role": "user", "content": f"Story {i}: " + "the sea was calm and the sky was grey. " * 12},
            {"role": "assistant", "content": "I see."},
        ]
    ask = [*long_turns, {"role": "user", "content": QUESTION}]
    with pytest.raises(openai.BadRequestError) as e:
        create(client, input=ask)
    assert e.value.body["param"] == "input"
    fitted = create(client, input=ask, truncation="auto")
    assert fitted.truncation == "auto" and fitted.output_text
    assert fitted.usage.input_tokens + TOKENS <= CONTEXT
    last_turns = create(client, input=ask[-5:])  # greedy: the same answer as the turns it kept
    assert fitted.usage.input_tokens >= last_turns.usage.input_tokens
    items = client.responses.input_items.list(fitted.id, limit=100)
    assert len(items.data) == len(ask)  # what it was given is stored whole


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "x" * 40_000}, "input"),  # over the context
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "model": "other-model"}, "model"),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(server, fields, param):
    r = httpx.post(server.url("/v1/responses"), json={"model": MODEL, **fields}, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200
