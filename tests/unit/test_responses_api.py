"""The Responses API's parts without a server: the request parser (items, fields mapped onto
chat's, refusals naming their field), items -> chat messages, the streamed events (a valid event
stack whose items add up to the whole answer's output items, whatever the split), and the store
two workers share."""

from __future__ import annotations

import json
import random
import time

import orjson
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from httpapi.chat_output import ChatDeltas, ChatOutput
from httpapi.errors import APIError
from httpapi.responses_output import ResponseEvents, ResponseHead, ResponseUsage, output_items
from httpapi.responses_request import chat_messages, parse_responses_create
from runtime.http_worker.response_store import ResponseStore, owner_of
from structured.reasoning import make_reasoning_parser
from structured.tool_parsers import make_parser
from structured.tools import MAX_TOOLS, parse_tool_choice, parse_tools

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def parse(**fields):
    return parse_responses_create(orjson.dumps(fields))


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as e:
        parse(**fields)
    assert e.value.status == 400, e.value.message
    return e.value


# ---------------------------------------------------------------- the request


def test_a_string_input_is_one_user_message():
    req = parse(model="m", input="Hi", max_output_tokens=7, temperature=0)
    (item,) = req.items
    assert item["type"] == "message" and item["role"] == "user" and item["id"].startswith("msg")
    assert item["content"] == [{"type": "input_text", "text": "Hi"}]
    assert (req.store, req.stream, req.background) == (True, False, False)
    assert req.sampling.max_tokens == 7 and req.sampling.params.temperature == 0


def test_items_of_every_served_kind_are_normalized():
    req = parse(
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"role": "assistant", "content": "It is sunny."},
        ]
    )
    assert [i["type"] for i in req.items] == [
        "message",
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
        "message",
    ]
    assert req.items[5]["content"] == [{"type": "output_text", "text": "It is sunny."}]
    assert all(i["id"] for i in req.items) and req.items[2]["id"] == "rs_1"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "background": True, "store": False}, "background"),
        ({"input": "x", "background": True, "stream": True}, "stream"),
        ({"input": "x", "stream_options": {}}, "stream_options"),
        ({"input": "x", "truncation": "middle"}, "truncation"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "max_tool_calls": 0}, "max_tool_calls"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ],
)
def test_bad_fields_are_400s_naming_them(fields, param):
    assert refused(**fields).param == param


def test_fields_map_onto_chats():
    req = parse(
        input="x",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        include=["message.output_text.logprobs", "reasoning.encrypted_content"],
        top_logprobs=3,
        reasoning={"effort": "low"},
        metadata={"k": "v"},
        parallel_tool_calls=False,
    )
    assert [t.name for t in req.tools] == ["get_weather"] and req.tool_choice.mode == "function"
    assert req.sampling.names["grammar"] == "tools"  # the named call is forced by its grammar, as chat's
    assert req.include_logprobs and req.sampling.params.top_logprobs == 3
    assert req.chat_template_kwargs == {"reasoning_effort": "low"}
    assert req.echo["metadata"] == {"k": "v"} and req.echo["tools"] == [WEATHER]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    req = parse(input="x", text=text)
    assert req.sampling.names["grammar"] == "text.format.schema" and req.echo["text"] == text


def namespace(name: str, *functions: dict) -> dict:
    return {"type": "namespace", "name": name, "description": "tools of " + name, "tools": list(functions)}


def test_a_namespace_names_its_functions_for_the_model_and_apart_in_the_calls():
    """vLLM's: the model sees "<namespace>__<name>"; a call's item carries the two apart; a named
    tool_choice may use a function's own name where one namespace has it."""
    req = parse(input="x", tools=[namespace("crm", WEATHER)], tool_choice={"type": "function", "name": "get_weather"})
    assert [t.name for t in req.tools] == ["crm__get_weather"] and req.tool_choice.name == "crm__get_weather"
    assert req.call_names == {"crm__get_weather": ("crm", "get_weather")}
    head = ResponseHead("resp_1", "m", {}, call_names=req.call_names)
    out = ChatOutput("resp_1", tools=req.tools, forced=req.tool_choice)
    items, _ = output_items(head, '{"city": "Oslo"}', "stop", out, None)
    assert [(i["name"], i["namespace"]) for i in items] == [("get_weather", "crm")]
    # sent back, the call is the model's flat name again
    messages, _ = chat_messages(None, parse(input=[{"role": "user", "content": "x"}, *items]).items)
    assert messages[1]["tool_calls"][0]["function"]["name"] == "crm__get_weather"
    plain, _ = output_items(ResponseHead("resp_2", "m", {}), '{"city": "Oslo"}', "stop", out, None)
    assert "namespace" not in plain[0]  # OpenAI's shape for a function of no namespace


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([namespace("a", WEATHER), namespace("b", WEATHER)], "get_weather", "tool_choice"),  # ambiguous
        ([namespace("a", {"type": "web_search"})], None, "tools[0].tools[0].type"),
        ([{"type": "namespace", "name": "a", "tools": []}], None, "tools[0].tools"),
        ([namespace("a" * 60, WEATHER)], None, "tools[0].tools[0].name"),  # its flat name is over 64
        ([namespace("a", {**WEATHER, "parameters": "x"})], None, "tools[0].tools[0].parameters"),
        ([namespace("a", *[{**WEATHER, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)])], None, "tools[0].tools"),
    ],
)
def test_bad_namespaces_are_400s_naming_the_place(tools, choice, param):
    fields = {"input": "x", "tools": tools}
    if choice is not None:
        fields["tool_choice"] = {"type": "function", "name": choice}
    assert refused(**fields).param == param


# ---------------------------------------------------------------- items -> chat messages


def test_calls_merge_into_the_assistant_turn_and_reasoning_is_left_out():
    req = parse(
        input=[
            {"role": "user", "content": "Weather in Oslo and Lima?"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "two calls"}]},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lima"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        ]
    )
    messages, rich = chat_messages("Be brief.", req.items)
    assert rich
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    calls = messages[2]["tool_calls"]
    assert messages[2]["content"] == "Let me look." and [c["id"] for c in calls] == ["c1", "c2"]
    assert calls[1]["function"] == {"name": "get_weather", "arguments": {"city": "Lima"}}
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "rain"}
    plain, rich = chat_messages(None, parse(input="Hi").items)
    assert plain == [{"role": "user", "content": "Hi"}] and not rich


def test_reasoning_alone_is_no_conversation():
    req = parse(input=[{"type": "reasoning", "content": []}])
    with pytest.raises(APIError) as e:
        chat_messages(None, req.items)
    assert e.value.param == "input"


# ---------------------------------------------------------------- streamed events

TOOLS = parse_tools([{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
OUTPUTS = {
    "plain": lambda: ChatOutput("resp_1"),
    "reasoning": lambda: ChatOutput("resp_1", reasoning=make_reasoning_parser("qwen3")),
    "reasoning+auto": lambda: ChatOutput(
        "resp_1",
        reasoning=make_reasoning_parser("deepseek-r1"),
        tool_parser=make_parser("hermes", ["get_weather"]),
        tools=TOOLS,
    ),
    "required": lambda: ChatOutput("resp_1", tools=TOOLS, forced=parse_tool_choice("required", TOOLS)),
}
TEXTS = [
    ("plain", "Hello there, é🙂!", "stop"),
    ("plain", "", "stop"),
    ("plain", "Cut sh", "length"),
    ("reasoning", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "stop"),
    ("reasoning+auto", 'Look it up.</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Oslo"}}\n</tool_call>', "stop"),
    ("required", '[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_weather","parameters":'
     '{"city":"Lima"}}]', "stop"),
]  # fmt: skip


STREAM_EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)


def events_of(stream: bytes) -> list[dict]:
    """The SSE stream's events, each checked: `event:` names the data's type."""
    out = []
    for block in stream.decode().split("\n\n"):
        if not block:
            continue
        head, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert head == "event: " + body["type"]
        out.append(body)
    return out


def check_stack(events: list[dict]) -> list[dict]:
    """Checks the stream is what OpenAI's clients expect (created, in_progress, each item added,
    its deltas, its .done events, then the terminal event; sequence numbers 0, 1, ...) and
    returns each item as its deltas built it."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    built: list[dict] = []
    open_item = None
    for e in events[2:-1]:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert open_item is None and e["output_index"] == len(built)
            open_item = {"item": e["item"], "text": ""}
        elif kind == "response.output_item.done":
            assert open_item is not None and e["item"]["id"] == open_item["item"]["id"]
            built.append({**e["item"], "streamed": open_item["text"]})
            open_item = None
        elif kind.endswith(".delta"):
            assert open_item is not None and e["item_id"] == open_item["item"]["id"]
            open_item["text"] += e["delta"]
        elif kind.endswith(".done") and kind != "response.content_part.done":
            text = e.get("text", e.get("arguments"))
            assert open_item is not None and text == open_item["text"], (kind, text, open_item)
    assert open_item is None
    return built


@pytest.mark.parametrize(("kind", "text", "finish"), TEXTS)
def test_a_stream_split_anywhere_is_a_valid_stack_adding_up_to_the_whole_output(kind, text, finish):
    head = ResponseHead("resp_1", "m", {**parse(input="x").echo, "temperature": 0.0, "top_p": 1.0})
    whole, reasoning = output_items(head, text, finish, OUTPUTS[kind](), None)
    rng = random.Random(text)
    splits = [[text], list(text)]
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        events = ResponseEvents(head, None, False)
        deltas = ChatDeltas(OUTPUTS[kind]())
        stream = events.start() + b"".join(events.feed(deltas.feed(p), None) for p in pieces if p)
        stream += events.feed(deltas.finish(finish)[0], None)
        last, response = events.finish(finish, ResponseUsage(3, len(pieces)))
        stack = events_of(stream + last)
        for event in stack:  # each event is one the official client's types accept
            STREAM_EVENT.validate_python(event)
        built = check_stack(stack)
        assert stack[-1]["response"] == response and response["output"] == whole, pieces
        for item in built:
            streamed = item.pop("streamed")
            if item["type"] == "function_call":
                assert streamed == item["arguments"]
            else:
                assert streamed == item["content"][0]["text"] if item["content"] else streamed == ""
        assert built == whole and events.reasoning == reasoning
        status = "incomplete" if finish == "length" else "completed"
        assert response["status"] == status and {i["status"] for i in whole} == {status}


# ---------------------------------------------------------------- the store workers share


def response(response_id: str, status: str = "completed") -> dict:
    return {"id": response_id, "status": status, "output": [{"type": "message", "id": "m_" + response_id}]}


A, B = owner_of("Bearer key-a"), owner_of("Bearer key-b")


def test_two_workers_share_the_store(tmp_path):
    one, two = ResponseStore(tmp_path / "r.db"), ResponseStore(tmp_path / "r.db")
    one.put(response("resp_a"), [{"id": "in_a"}], False, A)
    got = two.get("resp_a", A)
    assert got is not None and got.conversation == [{"id": "in_a"}, {"type": "message", "id": "m_resp_a"}]
    one.put(response("resp_b", "queued"), [], True, A)
    assert two.cancel("resp_b", A).status == "cancelled"
    assert not one.update_running(response("resp_b"), A)  # the runner's end does not undo a cancel
    assert one.get("resp_b", A).status == "cancelled"
    assert two.cancel("resp_a", A).status == "completed"  # a synchronous one is returned as it is
    assert one.delete("resp_a", A) and two.get("resp_a", A) is None and not two.delete("resp_a", A)
    one.close(), two.close()


def test_another_key_finds_nothing_and_replaces_nothing(tmp_path):
    store = ResponseStore(tmp_path / "r.db")
    store.put(response("resp_a", "queued"), [{"id": "a's input"}], True, A)
    assert store.get("resp_a", B) is None and store.cancel("resp_a", B) is None and not store.delete("resp_a", B)
    assert not store.update_running(response("resp_a"), B)
    store.put(response("resp_a"), [{"id": "b's input"}], False, B)  # the same id, B's own client request id
    assert store.get("resp_a", A).history == [{"id": "a's input"}] and store.get("resp_a", A).status == "queued"
    assert store.get("resp_a", B).history == [{"id": "b's input"}]
    assert owner_of(None) != A and len(A) == 16  # a digest: the store holds no key
    store.close()


def test_the_least_recently_used_go_first_over_any_bound(tmp_path):
    store = ResponseStore(tmp_path / "r.db", max_responses=3)
    for i in range(3):
        store.put(response(f"resp_{i}"), [], False, A)
    store.get("resp_0", A)  # read: now the most recently used
    store.put(response("resp_3"), [], False, A)
    assert [store.get(f"resp_{i}", A) is not None for i in range(4)] == [True, False, True, True]
    big = ResponseStore(tmp_path / "big.db", max_bytes=2000)  # two of the four below
    for i in range(4):
        big.put(response(f"resp_{i}"), [{"text": "x" * 900}], False, A)
    assert [big.get(f"resp_{i}", A) is not None for i in range(4)] == [False, False, True, True]
    old = ResponseStore(tmp_path / "old.db", max_age_s=0.2)
    old.put(response("resp_old"), [], False, A)
    time.sleep(0.3)
    assert old.get("resp_old", A) is None
    for s in (store, big, old):
        s.close()
