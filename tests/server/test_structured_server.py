"""Structured output and tool calls for real: `granian ... runtime.app:app` on the default model
(SmolLM2-135M), driven with the official openai client.

JSON-schema answers parse and validate against their schemas (jsonschema) for 24 schemas,
streamed and not, with n=2, sent at once beside unconstrained requests so that constrained and
unconstrained rows share steps; regex answers full-match; guided_choice answers are a choice;
forced tool calls (tool_choice "required" and a named function) validate against the tool's
parameters, and a stream's tool-call deltas (sent as the call's JSON arrives) reassemble to the
non-streamed call; grammars that
do not compile and tools that do not exist are 400s naming the field, and the server stays
healthy. Every request is greedy, so the streamed and the non-streamed answers are the same."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from bad_requests import MODEL

MAX_TOKENS = 160  # every schema below bounds its answer well inside this
NEIGHBOURS = 4  # unconstrained requests sent with the constrained ones

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["score"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                },
                "required": ["name", "population"],
            }
        },
        "required": ["city"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
        "required": ["code"],
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -100, "maximum": 100},
                        "y": {"type": "integer", "minimum": -100, "maximum": 100},
                    },
                    "required": ["x", "y"],
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["points"],
    },
    {
        "type": "object",
        "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}, "label": {"type": "string", "maxLength": 12}},
        "required": ["level", "label"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 1, "maximum": 1000},
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 1, "maximum": 5},
        },
        "required": ["title", "year", "rating"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "roles": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                        "maxItems": 2,
                    },
                },
                "required": ["id", "roles"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
        "required": ["email"],
    },
    {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50}, "unit": {"const": "C"}},
        "required": ["temperature", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["open", "closed"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 50},
            "note": {"type": "string", "maxLength": 15},
        },
        "required": ["status", "count"],
    },
    {
        "type": "object",
        "properties": {
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "string", "maxLength": 8}, {"type": "integer", "minimum": 0, "maximum": 9}],
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["pair"],
    },
    {"type": "boolean"},
]
PROMPT = "Answer with a JSON value for this request: describe something from your day."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 30}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
REGEX = r"(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day, [0-9]{1,2} (May|June) 20[0-9]{2}"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian, workers=1, log_level="warning", max_total_tokens=65536, max_running_requests=96
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=600)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def streamed_text(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts


def streamed_calls(chunks) -> list[dict]:
    """A stream's tool-call deltas reassembled as a client does: by index, name first."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            if delta.id:
                call["id"] = delta.id
            if delta.function.name:
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


@pytest.fixture(scope="module")
def answers(server, client):
    """Every request of the output tests, sent at once: the scheduler runs constrained and
    unconstrained rows in the same steps."""
    chat = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0)
    calls = {}
    for i, schema in enumerate(SCHEMAS):
        messages = [{"role": "user", "content": f"{PROMPT} ({i})"}]
        calls[("json", i)] = lambda m=messages, s=schema: client.chat.completions.create(
            messages=m, response_format=response_format(s), n=2, **chat
        )
        calls[("json_stream", i)] = lambda m=messages, s=schema: list(
            client.chat.completions.create(messages=m, response_format=response_format(s), stream=True, **chat)
        )
        if i < NEIGHBOURS:
            calls[("plain", i)] = lambda m=messages: client.chat.completions.create(
                messages=m, **{**chat, "max_tokens": 48}
            )
    calls["json_object"] = lambda: client.chat.completions.create(
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"},
        **chat,
    )
    calls["regex"] = lambda: client.completions.create(
        model=MODEL, prompt="The meeting is on", max_tokens=40, temperature=0, extra_body={"guided_regex": REGEX}
    )
    calls["regex_generate"] = lambda: httpx.post(
        server.url("/generate"),
        timeout=600,
        json={"text": "The meeting is on", "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": REGEX}},
    ).json()
    calls["choice"] = lambda: client.chat.completions.create(
        messages=[{"role": "user", "content": "Is the sky green?"}],
        extra_body={"guided_choice": ["yes", "no", "it depends"]},
        **chat,
    )
    for name, tool_choice in (
        ("required", "required"),
        ("named", {"type": "function", "function": {"name": "get_weather"}}),
    ):
        # a 135M model repeats a call for ever when it may make several: one call for "required"
        one = {"parallel_tool_calls": False} if tool_choice == "required" else {}
        calls[name] = lambda c=tool_choice, o=one: client.chat.completions.create(
            messages=ASK_WEATHER, tools=TOOLS, tool_choice=c, **o, **chat
        )
        calls[name + "_stream"] = lambda c=tool_choice, o=one: list(
            client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, tool_choice=c, stream=True, **o, **chat)
        )
    calls["auto"] = lambda: client.chat.completions.create(messages=ASK_WEATHER, tools=TOOLS, **chat)
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {key: pool.submit(call) for key, call in calls.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_answers_validate(answers, i):
    schema = SCHEMAS[i]
    response = answers[("json", i)]
    assert len(response.choices) == 2
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    (streamed,) = streamed_text(answers[("json_stream", i)]).values()
    assert streamed == response.choices[0].message.content  # greedy: the same answer
    assert answers[("json_stream", i)][-1].choices[0].finish_reason == "stop"


def test_constrained_rows_do_not_change_their_neighbours(answers, client):
    """An unconstrained greedy request sent beside the constrained ones answers as it does alone."""
    alone = client.chat.completions.create(
        model=MODEL, max_tokens=48, temperature=0, messages=[{"role": "user", "content": f"{PROMPT} (3)"}]
    )
    assert answers[("plain", 3)].choices[0].message.content == alone.choices[0].message.content
    assert not any(
        answers[("plain", i)].choices[0].message.content.startswith(answers[("json", i)].choices[0].message.content)
        for i in range(NEIGHBOURS)
    )


def test_json_object_regex_and_choice(answers):
    assert isinstance(json.loads(answers["json_object"].choices[0].message.content), dict)
    assert re.fullmatch(REGEX, answers["regex"].choices[0].text)
    assert re.fullmatch(REGEX, answers["regex_generate"]["text"])
    assert answers["choice"].choices[0].message.content in ("yes", "no", "it depends")


@pytest.mark.parametrize("name", ["required", "named"])
def test_forced_tool_calls_validate_and_streams_reassemble(answers, name):
    message = answers[name].choices[0].message
    assert answers[name].choices[0].finish_reason == "tool_calls"
    assert message.tool_calls and message.content is None
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    if name == "named":
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    chunks = answers[name + "_stream"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    got = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in got] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in got)
    # the calls stream as their JSON arrives: a head first, then arguments over several chunks
    carrying = [i for i, chunk in enumerate(chunks) if chunk.choices and chunk.choices[0].delta.tool_calls]
    assert len(carrying) > 2 and carrying[0] < carrying[-1] - 1, carrying


def test_auto_tool_choice_answers_with_text_or_valid_calls(answers):
    """The model chooses: whatever it wrote is read by the hermes parser (the default template's format)."""
    choice = answers["auto"].choices[0]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
    else:
        assert choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_a_conversation_with_tool_calls_and_results(server, client):
    """Assistant tool_calls and tool results in the history reach the template; the answer is text."""
    messages = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    tokens = httpx.post(server.url("/tokenize"), json={"model": MODEL, "messages": messages, "tools": TOOLS}).json()
    text = httpx.post(server.url("/detokenize"), json={"tokens": tokens["tokens"]}).json()["text"]
    assert "<tool_call>" in text and "<tool_response>" in text and "get_time" in text
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=20, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": response_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})}, None),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}},
            "tool_choice",
        ),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
    ],
)
def test_bad_grammars_and_tools_are_400s_naming_the_field(client, body, param):
    body = dict(body)
    extra = body.pop("extra_body", None)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4, extra_body=extra, **body)
    got = e.value.body["param"]
    assert got == param if param else got.startswith("response_format")
    ok = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"
