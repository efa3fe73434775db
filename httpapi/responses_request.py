"""The /v1/responses body (OpenAI's Responses API) -> ResponsesRequest, each 400 naming its
field; and a conversation's items -> the chat messages its prompt renders from.

A Responses request is a chat request in other words: `input` is a list of items (messages,
function calls, their outputs, reasoning) or one string, `instructions` a system message put
first, `max_output_tokens` the chat's max_completion_tokens, `text.format` its response_format,
tools are flat ({"type": "function", "name", ...}). The sampling fields read as chat's do
(vLLM's extras, such as top_k and repetition_penalty, included). Items are kept as the client
sent them, normalized and given ids, so that a stored response's conversation can be
continued (previous_response_id) and listed (/input_items)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from httpapi.chat_request import (
    REASONING_EFFORTS,
    REFUSED_CHAT,
    ChatTemplateArgs,
    forced_call_schema_of,
    read_thinking_budget,
    template_kwargs,
    template_tools,
    text_parts,
)
from httpapi.errors import bad_request
from httpapi.fields import Fields, load_object
from httpapi.grammar_fields import json_schema_format, one_grammar, structured_outputs
from httpapi.request_fields import (
    REFUSED_OPENAI,
    check_ignored,
    ignored_fields,
    read_request_id,
    refuse_unserved,
    shown,
)
from httpapi.responses import new_request_id
from httpapi.sampling import SamplingSpec, read_sampling
from protocol.sampling_params import GrammarKind
from structured.grammars import JSON_OBJECT_SCHEMA, json_schema_text
from structured.tools import MAX_TOOLS, InvalidTool, Tool, ToolChoice, parse_tool_choice, parse_tools

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values that ask for nothing this server has: encrypted reasoning (the Agents SDK and
# Codex ask for it with store false; a reasoning item here carries its text in the clear)
INCLUDE_NOTHING = ("reasoning.encrypted_content",)
MAX_TOP_LOGPROBS = 20
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# OpenAI's Responses fields this server does not serve: field -> why (refuse_unserved's table)
REFUSED_RESPONSES = {
    **REFUSED_CHAT,
    "kv_transfer_params": REFUSED_OPENAI["kv_transfer_params"],  # chat's pre-tokenized prompt has no twin here
    "use_beam_search": "beam search is served on /v1/completions and /v1/chat/completions, not on /v1/responses",
    "stop_regex": "stop_regex is served on /v1/completions and /v1/chat/completions, not on /v1/responses",
    "conversation": "conversations are not supported: continue a stored response with previous_response_id",
    "prompt": "prompt templates are not supported: send input (and instructions)",
    "context_management": "context management (compaction) is not supported",
    "background_options": "background_options are not supported",
    "moderation": "moderation is not supported",
    "image": "this server runs a text-only model: no image output",
    "access_programs": "access_programs are not supported",
    "prompt_cache_options": "prompt_cache_options are not supported: the prefix cache is automatic",
    "prompt_cache_retention": "prompt_cache_retention is not supported: the prefix cache is automatic",
    "previous_input_messages": "previous_input_messages (Harmony messages) is not supported: "
    "continue with previous_response_id, or send the conversation as input",
}
IGNORED_RESPONSES = ignored_fields({"str": ("user", "service_tier", "prompt_cache_key", "safety_identifier")})


@dataclass(frozen=True)
class ResponsesRequest:
    model: str | None
    items: list[dict[str, Any]]  # `input` as items, normalized, each with an id
    instructions: str | None
    sampling: SamplingSpec
    tools: tuple[Tool, ...]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    max_tool_calls: int | None
    stream: bool
    store: bool
    background: bool
    previous_response_id: str | None
    include_logprobs: bool  # include: ["message.output_text.logprobs"]
    top_logprobs: int
    chat_template_kwargs: dict[str, Any]  # chat_template_kwargs, and reasoning.effort as reasoning_effort
    echo: dict[str, Any]  # the fields the response object repeats (tools, text, reasoning, metadata, ...)
    request_id: str | None = None  # the client's (vLLM's): the response's id is resp_<request_id>
    truncation: str = "disabled"  # "auto": the oldest turns are dropped until the input fits
    thinking_budget: int = -1  # vLLM's thinking_token_budget, as chat's
    # a namespace's function as the model calls it ("<namespace>__<name>") -> (namespace, name)
    call_names: dict[str, tuple[str, str]] = field(default_factory=dict)
    raw_messages: bool = False  # vLLM's enable_response_messages: the raw prompt and output, with ids

    # what ChatOutput reads of a chat request (routes.chat_output)
    include_reasoning: bool = True
    separate_reasoning: bool = True


def parse_responses_create(body: bytes) -> ResponsesRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    raw_input = f.raw("input")
    if raw_input is None:
        raise bad_request("input is required: a string, or a list of input items", "input")
    items = read_items(raw_input)
    instructions = f.get_str("instructions")
    store = f.get_bool("store", True)
    background = f.get_bool("background", False)
    if background and not store:
        raise bad_request("background can only be used when `store` is true", "background")
    stream = f.get_bool("stream", False)
    if background and stream:
        raise bad_request("background with stream is not supported: poll the stored response instead", "stream")
    options = f.get_object("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        options.get_bool("include_obfuscation", False)  # no obfuscation padding is sent: nothing to leave out
        options.warn_unknown("stream_options")
    previous = f.get_str("previous_response_id")
    tools, tool_choice, call_names = read_response_tools(f)
    parallel = f.get_bool("parallel_tool_calls", True)
    max_tool_calls = f.get_int("max_tool_calls", minimum=1)
    include_logprobs = read_include(f)
    raw_messages = f.get_bool("enable_response_messages", False)
    top_logprobs = f.get_int("top_logprobs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
    kwargs = template_kwargs(f)
    reasoning = read_reasoning(f)
    if reasoning.get("effort") is not None:
        kwargs.setdefault("reasoning_effort", reasoning["effort"])
    text = f.get_object("text")
    names = {"max_tokens": "max_output_tokens"}
    grammar = one_grammar(
        [
            *_forced(tools, tool_choice, parallel and max_tool_calls != 1),
            *(_text_format(text) if text is not None else []),
            *structured_outputs(f, names),
        ],
        names,
    )
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        logprobs=include_logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=-1,
        return_ids=raw_messages,
        **grammar,
    )
    truncation = f.get_str("truncation", "disabled", choices=("disabled", "auto"))
    metadata = read_metadata(f)
    request_id = read_request_id(f)
    max_output_tokens = f.get_int("max_output_tokens")
    thinking_budget = read_thinking_budget(f, names)
    refuse_unserved(f, REFUSED_RESPONSES)
    check_ignored(f, IGNORED_RESPONSES)
    f.warn_unknown("/v1/responses")
    sampling = SamplingSpec.build(values, max_output_tokens, names, "input")
    echo = {
        "instructions": instructions,
        "metadata": metadata,
        "parallel_tool_calls": parallel,
        "max_tool_calls": max_tool_calls,
        "previous_response_id": previous,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "text": {"format": text.obj.get("format") or {"type": "text"}}
        if text is not None
        else {"format": {"type": "text"}},
        "tool_choice": f.obj.get("tool_choice") or ("auto" if tools else "none"),
        "tools": f.obj.get("tools") or [],
        "top_logprobs": top_logprobs,
        "truncation": truncation,
        "user": f.obj.get("user"),
        "store": store,
        "background": background,
        "service_tier": "default",
    }
    return ResponsesRequest(
        model,
        items,
        instructions,
        sampling,
        tools,
        tool_choice,
        parallel,
        max_tool_calls,
        stream,
        store,
        background,
        previous,
        include_logprobs,
        top_logprobs,
        kwargs,
        echo,
        request_id,
        truncation,
        thinking_budget,
        call_names,
        raw_messages,
    )


def read_include(f: Fields) -> bool:
    """include: whether it asks for the output text's logprobs; anything else it may ask for
    (a hosted tool's results, images) is a 400."""
    include = f.raw("include")
    if include is None:
        return False
    if type(include) is not list or not all(type(v) is str for v in include):
        raise bad_request("include must be a list of strings", "include")
    for value in include:
        if value != LOGPROBS_INCLUDE and value not in INCLUDE_NOTHING:
            raise bad_request(
                f"include {shown(value)} is not supported: only {LOGPROBS_INCLUDE!r} (and "
                f"{', '.join(map(repr, INCLUDE_NOTHING))}, which adds nothing here)",
                "include",
            )
    return LOGPROBS_INCLUDE in include


def read_reasoning(f: Fields) -> dict[str, Any]:
    """reasoning: {effort, summary}: the effort goes to the chat template (reasoning_effort),
    as for chat; no summary is written (a reasoning item's summary is empty)."""
    r = f.get_object("reasoning")
    if r is None:
        return {}
    effort = r.get_str("effort", choices=REASONING_EFFORTS)
    summary = r.get_str("summary")
    r.get_str("generate_summary")
    r.warn_unknown("reasoning")
    return {"effort": effort, "summary": summary}


def read_metadata(f: Fields) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, kept with the response and returned."""
    m = f.get_object("metadata")
    if m is None:
        return None
    if len(m.obj) > MAX_METADATA_KEYS:
        raise bad_request(f"metadata may have at most {MAX_METADATA_KEYS} keys", "metadata")
    for key, value in m.obj.items():
        if len(key) > MAX_METADATA_KEY_CHARS or type(value) is not str or len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters and values strings of "
                f"at most {MAX_METADATA_VALUE_CHARS}",
                "metadata",
            )
    return dict(m.obj)


# vLLM's name for a namespace's function as the model sees it: "<namespace>__<name>"
NAMESPACE_SEPARATOR = "__"


def read_response_tools(f: Fields) -> tuple[tuple[Tool, ...], ToolChoice, dict[str, tuple[str, str]]]:
    """Responses' flat function tools ({"type": "function", "name", "description", "parameters",
    "strict"}), namespaces of them ({"type": "namespace", "name", "tools": [...]}) and
    tool_choice ("none", "auto", "required" or {"type": "function", "name"}), checked as chat's
    are; a hosted tool (web search, file search, MCP, ...) is a 400. A namespace's functions are
    shown to the model as "<namespace>__<name>", as vLLM does; the map returned gives each such
    name its (namespace, name), which the output's calls carry apart."""
    raw = f.raw("tools")
    if raw is not None and type(raw) is not list:
        raise bad_request("tools must be a list of tools", "tools")
    chat_tools: list[dict] = []
    places: list[str] = []  # each chat tool's place in the request, for its errors
    call_names: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(raw or []):
        kind = tool.get("type") if type(tool) is dict else None
        if kind == "namespace":
            chat_tools += _namespace_tools(tool, f"tools[{i}]", places, call_names)
            continue
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: only function tools (and namespaces of them) are served, not {shown(kind)} "
                "(hosted tools run at OpenAI)",
                f"tools[{i}].type",
            )
        chat_tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        places.append(f"tools[{i}]")
    try:
        tools = parse_tools(chat_tools or None)
        choice = parse_tool_choice(_chat_tool_choice(f.raw("tool_choice"), tools, call_names), tools)
    except InvalidTool as e:
        raise bad_request(str(e), _request_place(e.param, places)) from None
    return tools, choice, call_names


def _namespace_tools(tool: dict, where: str, places: list[str], call_names: dict[str, tuple[str, str]]) -> list[dict]:
    """A namespace's function tools as chat tools named "<namespace>__<name>"."""
    namespace, members = tool.get("name"), tool.get("tools")
    if type(namespace) is not str or not namespace:
        raise bad_request(f"{where}.name must be the namespace's name, a non-empty string", f"{where}.name")
    if type(members) is not list or not members:
        raise bad_request(f"{where}.tools must be a non-empty list of function tools", f"{where}.tools")
    if len(members) > MAX_TOOLS:  # before a pass over what a client may make huge
        raise bad_request(f"{where}.tools: at most {MAX_TOOLS} tools, got {len(members)}", f"{where}.tools")
    out = []
    for j, member in enumerate(members):
        kind = member.get("type") if type(member) is dict else None
        if kind != "function":
            raise bad_request(
                f"{where}.tools[{j}]: a namespace's tools must be function tools, not {shown(kind)}",
                f"{where}.tools[{j}].type",
            )
        name = member.get("name")
        if type(name) is not str:
            raise bad_request(f"{where}.tools[{j}].name must be a string", f"{where}.tools[{j}].name")
        flat = namespace + NAMESPACE_SEPARATOR + name
        call_names[flat] = (namespace, name)
        out.append({"type": "function", "function": {**{k: v for k, v in member.items() if k != "type"}, "name": flat}})
        places.append(f"{where}.tools[{j}]")
    return out


def _chat_tool_choice(choice: Any, tools: tuple[Tool, ...], call_names: dict[str, tuple[str, str]]) -> Any:
    """tool_choice in chat's form; a named function may be a namespace's by its own name where
    only one namespace has it (vLLM's rule), else by "<namespace>__<name>"."""
    if type(choice) is not dict:
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or type(name) is not str:
        raise bad_request(
            f"tool_choice {shown(choice)} is not served: use 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}',
            "tool_choice",
        )
    if not any(tool.name == name for tool in tools):
        flat = [full for full, (_, own) in call_names.items() if own == name]
        if len(flat) > 1:
            raise bad_request(
                f"tool_choice names {name!r}, which more than one namespace defines: name it as "
                f"'<namespace>{NAMESPACE_SEPARATOR}<name>' ({', '.join(flat)})",
                "tool_choice",
            )
        name = flat[0] if flat else name
    return {"type": "function", "function": {"name": name}}


def _request_place(param: str, places: list[str]) -> str:
    """A chat tool's error's param ("tools[k].function.name") as the place it has in this request."""
    found = re.fullmatch(r"tools\[(\d+)\](?:\.function)?(.*)", param)
    return places[int(found.group(1))] + found.group(2) if found else param


def _forced(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool) -> list[tuple[str, GrammarKind, Any]]:
    schema = forced_call_schema_of(tools, choice, parallel)
    return [] if schema is None else [("tools", GrammarKind.JSON_SCHEMA, lambda: json_schema_text(schema))]


def _text_format(text: Fields) -> list[tuple[str, GrammarKind, Any]]:
    """text.format: "text", "json_object", or {"type": "json_schema", "name", "schema", "strict"}
    (flat, where chat nests it in json_schema)."""
    fmt = text.get_object("format")
    text.get_str("verbosity")
    text.warn_unknown("text")
    if fmt is None:
        return []
    kind = fmt.get_str("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("text.format", GrammarKind.JSON_SCHEMA, lambda: JSON_OBJECT_SCHEMA)]
    if kind == "json_schema":
        return json_schema_format(fmt, "text.format")
    raise bad_request(
        f"text.format.type must be one of text, json_object and json_schema, not {shown(kind)}", "text.format.type"
    )


# ---------------------------------------------------------------- items


def read_items(value: Any) -> list[dict[str, Any]]:
    """`input`: a string (one user message) or a list of items, normalized: messages with their
    text parts, function calls, their outputs and reasoning items, each with an id."""
    if type(value) is str:
        return [_message("user", [{"type": "input_text", "text": value}])]
    if type(value) is not list or not value:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _message(role: str, content: list[dict[str, Any]], item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_request_id("msg"), "role": role, "content": content}


def _item(item: Any, where: str) -> dict[str, Any]:
    if type(item) is not dict:
        raise bad_request(f"{where} must be an input item object", where)
    kind = item.get("type", "message" if "role" in item else None)
    item_id = _opt_str(item, "id", where)
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"{where}.role must be one of {list(MESSAGE_ROLES)}, not {shown(role)}", f"{where}.role")
        return _message(role, _parts(item.get("content"), role, f"{where}.content"), item_id)
    if kind == "function_call":
        name, arguments = _str(item, "name", where), _str(item, "arguments", where)
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = None
        if type(parsed) is not dict:
            raise bad_request(f"{where}.arguments must be the JSON text of an object", f"{where}.arguments")
        call_id = _str(item, "call_id", where)
        namespace = _opt_str(item, "namespace", where)
        return {
            "type": "function_call",
            "id": item_id or new_request_id("fc"),
            "call_id": call_id,
            "name": name,
            **({"namespace": namespace} if namespace else {}),
            "arguments": arguments,
            "status": "completed",
        }
    if kind == "function_call_output":
        output = item.get("output")
        text = output if type(output) is str else _joined(output, "user", f"{where}.output")
        return {
            "type": "function_call_output",
            "id": item_id or new_request_id("fco"),
            "call_id": _str(item, "call_id", where),
            "output": text,
        }
    if kind == "reasoning":
        content = item.get("content") or []
        texts = _joined(content, "reasoning", f"{where}.content") if content else ""
        return {
            "type": "reasoning",
            "id": item_id or new_request_id("rs"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": texts}] if texts else [],
        }
    raise bad_request(
        f"{where}.type {shown(kind)} is not served: input items are messages, function_call, "
        "function_call_output and reasoning",
        f"{where}.type",
    )


def _parts(value: Any, role: str, where: str) -> list[dict[str, Any]]:
    """A message's content as text parts (input_text for the client's roles, output_text for the assistant)."""
    kind = "output_text" if role == "assistant" else "input_text"
    if type(value) is str:
        return [{"type": kind, "text": value}]
    return [{"type": kind, "text": _joined(value, role, where)}]


def _joined(value: Any, role: str, where: str) -> str:
    """Text parts' texts joined by newlines, as chat joins its parts (chat_request.text_parts)."""
    return text_parts(value, role, where, (*TEXT_PARTS, "reasoning_text"))


def _str(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if type(value) is not str or not value and key != "arguments":
        raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _opt_str(item: dict, key: str, where: str) -> str | None:
    value = item.get(key)
    if value is not None and type(value) is not str:
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
    """The conversation as the chat template reads it (httpapi/chat_request.py's messages):
    instructions first as a system message, function calls as the tool_calls of an assistant
    message (consecutive calls, and an assistant message just before them, merge into one; a
    namespace's function by "<namespace>__<name>", as the model was shown it), their outputs as
    tool messages. Reasoning items are left out: chat templates drop earlier
    turns' reasoning. Also whether any message calls or answers a tool (then the chat renders
    through apply_chat_template)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    rich = False
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": "\n".join(p["text"] for p in item["content"])})
        elif kind == "function_call":
            rich = True
            name = item["name"] if "namespace" not in item else item["namespace"] + NAMESPACE_SEPARATOR + item["name"]
            call = {
                "type": "function",
                "id": item["call_id"],
                "function": {"name": name, "arguments": orjson.loads(item["arguments"])},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            rich = True
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    if not messages:
        raise bad_request("input has no message to answer (reasoning items alone are not a conversation)", "input")
    return messages, rich


def template_args(tools: tuple[Tool, ...], kwargs: dict[str, Any], rich: bool) -> ChatTemplateArgs | None:
    """The chat template's arguments (None: the plain render), as chat's read_template_args makes them."""
    if not (rich or tools or kwargs):
        return None
    return ChatTemplateArgs(tools=template_tools(tools), kwargs=kwargs)
