"""A chat request's tools and tool_choice: OpenAI's validation, the schemas forced calls are
constrained to (they must compile with xgrammar and accept what they should), and reading the
calls back from constrained output."""

from __future__ import annotations

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string as grammar_accepts

from structured.tools import (
    MAX_TOOLS,
    MAX_TOOLS_BYTES,
    InvalidTool,
    Tool,
    ToolChoice,
    forced_call_schema,
    parse_tool_choice,
    parse_tools,
)


def function(name: str, parameters: dict | None = None, **extra: object) -> dict:
    spec: dict = {"name": name, **extra}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


WEATHER = function(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    description="Current weather in a city",
)
SEARCH = function(
    "search_web",
    {"type": "object", "properties": {"q": {"type": "string"}, "top_k": {"type": "integer", "minimum": 1}}},
    strict=True,
)
NO_PARAMETERS = function("get_time")
NESTED = function(
    "book_flight",
    {
        "type": "object",
        "properties": {
            "route": {"$ref": "#/$defs/Route"},
            "passengers": {"type": "array", "items": {"$ref": "#/$defs/Person"}, "minItems": 1},
            "class": {"anyOf": [{"const": "economy"}, {"const": "business"}]},
            "notes": {"type": ["string", "null"]},
        },
        "required": ["route", "passengers"],
        "$defs": {
            "Route": {
                "type": "object",
                "properties": {"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string"}},
                "required": ["from", "to"],
            },
            "Person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}},
        },
    },
)
ALL = [WEATHER, SEARCH, NO_PARAMETERS, NESTED]


def test_parse_tools() -> None:
    tools = parse_tools(ALL)
    assert [t.name for t in tools] == ["get_weather", "search_web", "get_time", "book_flight"]
    assert tools[0] == Tool("get_weather", "Current weather in a city", WEATHER["function"]["parameters"], None)
    assert tools[1].strict is True
    assert tools[2].parameters == {"type": "object", "properties": {}}
    assert parse_tools(None) == ()


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ({"type": "function"}, "tools"),
        ([], "tools"),
        ([WEATHER] * 2, "tools[1].function.name"),
        ([WEATHER, "get_time"], "tools[1]"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
        ([function("get weather")], "tools[0].function.name"),
        ([function("x" * 65)], "tools[0].function.name"),
        ([function("")], "tools[0].function.name"),
        ([function("ok", description=3)], "tools[0].function.description"),
        ([SEARCH, function("ok", ["not", "a", "schema"])], "tools[1].function.parameters"),
        ([function("ok", strict="yes")], "tools[0].function.strict"),
        ([function(f"t{i}") for i in range(MAX_TOOLS + 1)], "tools"),
        ([function("big", description="x" * MAX_TOOLS_BYTES)], "tools"),
    ],
)
def test_invalid_tools(value: object, param: str) -> None:
    with pytest.raises(InvalidTool) as raised:
        parse_tools(value)
    assert raised.value.param == param
    assert isinstance(raised.value, ValueError)


def test_tool_limits_are_inclusive() -> None:
    assert len(parse_tools([function(f"t{i}") for i in range(MAX_TOOLS)])) == MAX_TOOLS
    assert parse_tools([function("a_B-9" + "x" * 59)])[0].name == "a_B-9" + "x" * 59


def test_tool_choice() -> None:
    tools = parse_tools(ALL)
    assert parse_tool_choice(None, tools) == ToolChoice("auto")
    assert parse_tool_choice(None, ()) == ToolChoice("none")
    assert parse_tool_choice("none", ()) == ToolChoice("none")
    for mode in ("none", "auto", "required"):
        assert parse_tool_choice(mode, tools) == ToolChoice(mode)
    named = {"type": "function", "function": {"name": "search_web"}}
    assert parse_tool_choice(named, tools) == ToolChoice("function", "search_web")


@pytest.mark.parametrize(
    ("value", "tools"),
    [
        ("always", ALL),
        ({"type": "function", "function": {"name": "nope"}}, ALL),
        ({"type": "function", "name": "get_weather"}, ALL),
        ({"type": "function", "function": "get_weather"}, ALL),
        (["auto"], ALL),
        ("auto", []),
        ("required", []),
    ],
)
def test_invalid_tool_choice(value: object, tools: list) -> None:
    with pytest.raises(InvalidTool) as raised:
        parse_tool_choice(value, parse_tools(tools or None))
    assert raised.value.param == "tool_choice"


def compiled(schema: str) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_json_schema(schema)


def test_no_schema_when_the_model_chooses() -> None:
    tools = parse_tools(ALL)
    assert forced_call_schema(tools, ToolChoice("auto")) is None
    assert forced_call_schema(tools, ToolChoice("none")) is None


@pytest.mark.parametrize("tool", ALL, ids=lambda t: t["function"]["name"])
def test_named_function_schema_is_its_parameters(tool: dict) -> None:
    tools = parse_tools(ALL)
    name = tool["function"]["name"]
    schema = forced_call_schema(tools, ToolChoice("function", name))
    assert json.loads(schema) == tool["function"].get("parameters", {"type": "object", "properties": {}})
    compiled(schema)


def test_required_schema_compiles_and_accepts_calls_only() -> None:
    tools = parse_tools(ALL)
    schema = forced_call_schema(tools, ToolChoice("required"))
    assert json.loads(schema)["$defs"].keys() == {"Route", "Person"}  # lifted, so "#/$defs/..." resolves
    grammar = compiled(schema)
    accepted = [
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        '[{"name": "get_time", "parameters": {}}, {"name": "search_web", "parameters": {"q": "x", "top_k": 3}}]',
        '[{"name": "book_flight", "parameters": {"route": {"from": "ZRH", "to": "NRT"}, '
        '"passengers": [{"name": "Ana", "age": 31}], "class": "economy", "notes": null}}]',
    ]
    rejected = [
        "[]",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        '[{"name": "unknown", "parameters": {}}]',
        '[{"name": "get_weather", "parameters": {"town": "Paris"}}]',
        '[{"name": "get_weather"}]',
        '[{"name": "book_flight", "parameters": {"route": {"from": "zurich", "to": "NRT"}, "passengers": [{}]}}]',
    ]
    for text in accepted:
        assert grammar_accepts(grammar, text), text
    for text in rejected:
        assert not grammar_accepts(grammar, text), text


def test_one_call_when_parallel_calls_are_off() -> None:
    grammar = compiled(forced_call_schema(parse_tools(ALL), ToolChoice("required"), max_calls=1))
    assert grammar_accepts(grammar, '[{"name": "get_time", "parameters": {}}]')
    assert not grammar_accepts(
        grammar, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]'
    )


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {}},
        {"type": "object"},
        {},
        {"type": "object", "properties": {"n": {"type": "number", "minimum": 0, "maximum": 1}}},
        {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}},
        {"type": "object", "properties": {"x": {"oneOf": [{"type": "integer"}, {"type": "string", "format": "date"}]}}},
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {
            "type": "object",
            "properties": {"tree": {"$ref": "#/definitions/Node"}},
            "definitions": {
                "Node": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}}},
                }
            },
        },
        {"type": "object", "properties": {"unicode": {"type": "string", "description": "名前 — ñ", "default": "é"}}},
    ],
)
def test_schemas_compile_for_every_choice(parameters: dict) -> None:
    tools = parse_tools([function("only", parameters), NO_PARAMETERS])
    compiled(forced_call_schema(tools, ToolChoice("function", "only")))
    compiled(forced_call_schema(tools, ToolChoice("required")))


def test_required_refuses_clashing_definitions() -> None:
    a = function("a", {"type": "object", "$defs": {"X": {"type": "string"}}})
    b = function("b", {"type": "object", "$defs": {"X": {"type": "integer"}}})
    same = function("c", {"type": "object", "$defs": {"X": {"type": "string"}}})
    compiled(forced_call_schema(parse_tools([a, same]), ToolChoice("required")))
    with pytest.raises(InvalidTool) as raised:
        forced_call_schema(parse_tools([a, b]), ToolChoice("required"))
    assert raised.value.param == "tools"
