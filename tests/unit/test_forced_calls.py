"""A forced call's JSON read as it arrives (structured/forced_calls.py), against the JSON itself:
texts the forced-call grammar accepts (checked with xgrammar), written with and without
whitespace, give each call's name and its arguments as compact JSON; a stream split anywhere adds
up to the whole parse; every prefix (a text cut by max_tokens) streams a prefix of the calls
(the last one cut) and parses to the calls complete in it, never content."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from structured.forced_calls import ForcedCalls
from structured.tool_parsers import ArgumentsDelta, CallStart, ToolCall
from structured.tools import ToolChoice, forced_call_schema, parse_tools

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
        {
            "type": "function",
            "function": {
                "name": "plot",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "points": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                        "style": {"type": "object", "properties": {"color": {"type": "string"}}},
                    },
                },
            },
        },
    ]
)
CITIES = ["Paris", "Zürich", 'a "quoted" {city}', "back\\slash", "tab\tand [brackets], commas", ""]


def random_call(rng: random.Random) -> tuple[str, dict]:
    name = rng.choice(["get_weather", "get_time", "plot"])
    if name == "get_weather":
        args: dict = {"city": rng.choice(CITIES)}
        if rng.random() < 0.5:
            args["days"] = rng.randint(-5, 10**6)
    elif name == "get_time":
        args = {}
    else:
        args = {"points": [[rng.randint(0, 9), rng.random()] for _ in range(rng.randint(0, 3))]}
        if rng.random() < 0.5:
            args["style"] = {"color": rng.choice(CITIES)}
    return name, args


def written(value: object, rng: random.Random) -> str:
    """JSON as a model may write it under a grammar that allows whitespace, or compact."""
    style = rng.choice([{"separators": (",", ":")}, {"indent": 2}, {"separators": (" , ", " : ")}, {}])
    return json.dumps(value, ensure_ascii=False, **style)


def compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def read_stream(reader: ForcedCalls, pieces: list[str]) -> list[ToolCall]:
    stream = reader.stream()
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls)  # heads in order, each once
            calls[e.index] = [e.name, ""]
        else:
            assert isinstance(e, ArgumentsDelta) and e.text
            calls[e.index][1] += e.text
    return [ToolCall(name, args) for name, args in calls.values()]


def splits(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)]
    for _ in range(8):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("seed", range(40))
def test_required_calls_are_read_whole_streamed_and_cut(seed):
    rng = random.Random(seed)
    calls = [random_call(rng) for _ in range(rng.randint(1, 3))]
    text = written([{"name": n, "parameters": a} for n, a in calls], rng)
    choice = ToolChoice("required")
    schema = forced_call_schema(TOOLS, choice)
    assert grammar_accepts(xgrammar.Grammar.from_json_schema(schema), text), text
    reader = ForcedCalls(TOOLS, choice)
    want = [ToolCall(n, compact(a)) for n, a in calls]
    parsed = reader.parse(text)
    assert parsed.content == "" and parsed.calls == want
    for pieces in splits(text, rng):
        assert read_stream(reader, pieces) == want, pieces
    for cut in range(len(text) + 1):
        sent = read_stream(reader, [text[:cut]])
        assert len(sent) <= len(want) and all(g.name == w.name for g, w in zip(sent, want)), text[:cut]
        assert all(w.arguments.startswith(g.arguments) for g, w in zip(sent, want)), text[:cut]
        assert sent[:-1] == want[: max(len(sent) - 1, 0)]  # only the last call can be cut
        whole = reader.parse(text[:cut]).calls
        assert whole == want[: len(whole)] and len(whole) >= len(sent) - 1, text[:cut]  # the complete ones


@pytest.mark.parametrize("seed", range(20))
def test_a_named_function_is_its_arguments(seed):
    rng = random.Random(seed)
    name, args = random_call(rng)
    choice = ToolChoice("function", name)
    text = written(args, rng)
    assert grammar_accepts(xgrammar.Grammar.from_json_schema(forced_call_schema(TOOLS, choice)), text), text
    reader = ForcedCalls(TOOLS, choice)
    assert reader.parse(text).calls == [ToolCall(name, compact(args))]
    for pieces in splits(text, rng):
        assert read_stream(reader, pieces) == [ToolCall(name, compact(args))]
    assert read_stream(reader, [""]) == []  # nothing written: no call yet
    assert read_stream(reader, [text[:1]]) == [ToolCall(name, "{")]  # the call starts with its first character
    assert reader.parse(text[:-1]).calls == []  # cut: no complete call


def test_the_name_may_follow_the_parameters_and_unknown_names_are_no_call():
    reader = ForcedCalls(TOOLS, ToolChoice("required"))
    text = '[{"parameters": {"city": "Oslo"}, "name": "get_weather"}, {"name": "nope", "parameters": {}}]'
    assert reader.parse(text).calls == [ToolCall("get_weather", '{"city":"Oslo"}')]
    escaped = '[{"name": "get\\u005ftime", "parameters": {}}]'  # a name written with an escape
    assert reader.parse(escaped).calls == [ToolCall("get_time", "{}")]


def test_auto_and_none_force_nothing():
    for mode in ("auto", "none"):
        with pytest.raises(ValueError):
            ForcedCalls(TOOLS, ToolChoice(mode))
