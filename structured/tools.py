"""The `tools` and `tool_choice` of a chat request, validated as OpenAI does, and the grammar a
forced call needs: with tool_choice "required" or a named function the model's output is
constrained to a JSON schema (as vLLM does) rather than left to a tool-call parser, and
`forced_calls` reads the calls back from that output."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

HERMES_TEMPLATE = Path(__file__).with_name("templates") / "hermes.jinja"  # ChatML with Hermes tool calls
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 128 * 1024  # the tools' JSON: they are rendered into every prompt of the request
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
SCHEMA_DEFINITIONS = ("$defs", "definitions")  # where `$ref`s point: "#/$defs/X", "#/definitions/X"


class InvalidTool(ValueError):
    """A request's tools or tool_choice that OpenAI would refuse; `param` names the field, as
    an OpenAI 400 error's `param` does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))  # a JSON schema
    strict: bool | None = None


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None  # the function's, for mode "function"


def parse_tools(value: object) -> tuple[Tool, ...]:
    """A request's `tools` (None: none given). Raises InvalidTool."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidTool("tools", "must be an array of tools")
    if not value:
        raise InvalidTool("tools", "must not be empty: leave tools out for none")
    if len(value) > MAX_TOOLS:
        raise InvalidTool("tools", f"at most {MAX_TOOLS} tools, got {len(value)}")
    try:
        size = len(orjson.dumps(value))
    except TypeError as e:
        raise InvalidTool("tools", f"not JSON: {e}") from None
    if size > MAX_TOOLS_BYTES:
        raise InvalidTool("tools", f"at most {MAX_TOOLS_BYTES} bytes of JSON, got {size}")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        tool = _parse_tool(item, f"tools[{i}]")
        if any(t.name == tool.name for t in tools):
            raise InvalidTool(f"tools[{i}].function.name", f"duplicate tool name {tool.name!r}")
        tools.append(tool)
    return tuple(tools)


def _parse_tool(item: object, param: str) -> Tool:
    if not isinstance(item, dict):
        raise InvalidTool(param, "must be an object")
    if item.get("type") != "function":
        raise InvalidTool(f"{param}.type", "must be 'function'")
    function = item.get("function")
    if not isinstance(function, dict):
        raise InvalidTool(f"{param}.function", "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidTool(f"{param}.function.name", "must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidTool(f"{param}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    elif not isinstance(parameters, dict):
        raise InvalidTool(f"{param}.function.parameters", "must be a JSON schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidTool(f"{param}.function.strict", "must be a boolean")
    return Tool(name, description, parameters, strict)


def parse_tool_choice(value: object, tools: tuple[Tool, ...]) -> ToolChoice:
    """A request's `tool_choice` (None: not given: "auto" with tools, else "none"). Raises
    InvalidTool: a choice other than "none" needs tools, and a named function must be one."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    elif (
        isinstance(value, dict)
        and value.get("type") == "function"
        and isinstance(value.get("function"), dict)
        and isinstance(value["function"].get("name"), str)
    ):
        name = value["function"]["name"]
        if not any(t.name == name for t in tools):
            raise InvalidTool("tool_choice", f"names function {name!r}, which is not among the tools")
        choice = ToolChoice("function", name)
    else:
        raise InvalidTool(
            "tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )
    if choice.mode != "none" and not tools:
        raise InvalidTool("tool_choice", "is only allowed when tools are given")
    return choice


def forced_call_schema(tools: tuple[Tool, ...], choice: ToolChoice, max_calls: int | None = None) -> str | None:
    """The JSON schema (text) the output of a forced call must match: for "required", a
    non-empty array of {"name", "parameters"} objects, one of the tools each; for a named
    function, its parameters. None when the model chooses (auto) or may not call (none).
    max_calls bounds the array (parallel_tool_calls false: 1).
    Raises InvalidTool when the tools' schema definitions clash (they share one `$defs`)."""
    if choice.mode == "function":
        return orjson.dumps(_tool_named(tools, choice.name).parameters).decode()
    if choice.mode != "required":
        return None
    definitions: dict[str, dict[str, Any]] = {}
    options = []
    for tool in tools:
        parameters = {
            k: v for k, v in tool.parameters.items() if k not in SCHEMA_DEFINITIONS or not isinstance(v, dict)
        }
        for key in SCHEMA_DEFINITIONS:
            defined = tool.parameters.get(key)
            for def_name, schema in defined.items() if isinstance(defined, dict) else ():
                if definitions.setdefault(key, {}).setdefault(def_name, schema) != schema:
                    raise InvalidTool("tools", f"tools define {key} {def_name!r} differently")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": options}, **definitions}
    if max_calls is not None:  # parallel_tool_calls false: a model that repeats calls cannot
        schema["maxItems"] = max_calls
    return orjson.dumps(schema).decode()


def _tool_named(tools: tuple[Tool, ...], name: str | None) -> Tool:
    return next(tool for tool in tools if tool.name == name)
