"""The /v1/chat/completions body -> ChatCompletionRequest: its messages, tools and the chat
template's arguments (which /tokenize's chat fields share), each 400 naming its field."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson
import regex

from httpapi.errors import APIError, bad_request
from httpapi.fields import Fields, ParseMemo, load_object
from httpapi.grammar_fields import read_grammar
from httpapi.request_fields import (
    MAX_CHOICES,
    REFUSED_OPENAI,
    BeamSearch,
    PromptTruncation,
    check_ignored,
    read_beam_search,
    read_logprobs_count,
    read_n,
    read_prompt_logprobs,
    read_request_id,
    read_stop_regex,
    read_stream,
    read_truncation,
    refuse_unserved,
    sglang_no_stop_trim,
    shown,
)
from httpapi.sampling import SamplingSpec, read_allowed_token_ids, read_logprob_token_ids, read_sampling
from protocol.request_records import MEMO_BYTES
from structured.tools import InvalidTool, Tool, ToolChoice, forced_call_schema, parse_tool_choice, parse_tools

REFUSED_CHAT = {  # served here
    k: why for k, why in REFUSED_OPENAI.items() if k not in ("thinking_token_budget", "kv_transfer_params")
}
# OpenAI's roles; vLLM passes any other role to the chat template, which renders it or refuses
# it (a 400). Bounded to a name, so that a role cannot carry the template's own markup.
CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file", "input_file")
# tool_choice's deprecated twin: values that ask for no call
NO_FUNCTION_CALL = ("none", "auto")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
# apply_chat_template's own arguments and the template's `messages`: not chat_template_kwargs
TEMPLATE_CALL_ARGS = frozenset(
    (
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "add_special_tokens",
    )
)
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10  # chat_template_kwargs' and documents' JSON


@dataclass(frozen=True)
class ChatTemplateArgs:
    """How a chat becomes a prompt besides its messages: apply_chat_template's keyword arguments
    and whether the rendered text gets the tokenizer's special tokens. A request that asks for
    none of it (and whose messages are plain role/content ones) has None: the fast render."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict] | None = None  # OpenAI's tool objects, as HF templates read them
    documents: list[dict] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs (and reasoning_effort)
    add_special_tokens: bool = False  # vLLM's: the template writes the special tokens itself

    def call_kwargs(self) -> dict[str, Any]:
        """apply_chat_template's keyword arguments, but messages and tokenize."""
        return {
            **self.kwargs,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "tools": self.tools,
            "documents": self.documents,
        }


@dataclass(frozen=True)
class ChatCompletionRequest:
    model: str | None
    messages: list[dict[str, Any]]  # {"role", "content"[, "name", "tool_calls", "tool_call_id"]}, for the template
    template: ChatTemplateArgs | None  # None: the plain render
    n: int
    stream: bool
    include_usage: bool
    sampling: SamplingSpec
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True  # False: at most one call in a choice (vLLM's)
    request_id: str | None = None  # the client's, vLLM's: the response's id is chatcmpl-<request_id>
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    # with a --reasoning-parser: false drops the reasoning (vLLM's include_reasoning), or leaves
    # it in the content (SGLang's separate_reasoning)
    include_reasoning: bool = True
    separate_reasoning: bool = True
    truncation: PromptTruncation | None = None  # vLLM's truncate_prompt_tokens
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the answer
    # vLLM's pre-tokenized prompt (prompt_token_ids, or kv_transfer_params'): used in place of the
    # rendered messages
    prompt_ids: tuple[int, ...] | None = None
    echo: str = ""  # vLLM's echo: the final message's content, which each choice's text then starts with
    tokens_as_ids: bool | None = None  # vLLM's return_tokens_as_token_ids (None: the server's default)
    thinking_budget: int = -1  # vLLM's thinking_token_budget: reasoning tokens at most (-1: no bound)
    stop_regex: tuple[regex.Pattern, ...] = ()  # SGLang's: a choice stops where one matches its text
    beam: BeamSearch | None = None  # vLLM's use_beam_search: n beams instead of n samples

    def with_messages(
        self, messages: list[dict[str, Any]], template: ChatTemplateArgs | None, echo: str
    ) -> ChatCompletionRequest:
        """This request with a request's own messages and what they decide: a copy of its
        __dict__, which dataclasses.replace() would make through the frozen __init__, one
        object.__setattr__ call for each of its ~20 fields, on every request."""
        request = object.__new__(ChatCompletionRequest)
        request.__dict__.update(self.__dict__, messages=messages, template=template, echo=echo)
        return request


def parse_chat_completion(body: bytes) -> ChatCompletionRequest:
    return chat_request_of(load_object(body))


def parse_batch_chat_completion(body: bytes) -> list[ChatCompletionRequest]:
    """vLLM's /v1/chat/completions/batch: `messages` is a list of conversations, every other
    field is shared; one choice per conversation (choice i answers conversation i). As vLLM's,
    it neither streams nor takes tools; n is 1."""
    obj = load_object(body)
    conversations = obj.get("messages")
    if type(conversations) is not list or not conversations or any(type(c) is not list for c in conversations):
        raise bad_request("messages must be a non-empty list of conversations (each a list of messages)", "messages")
    if len(conversations) > MAX_CHOICES:
        raise bad_request(f"messages: at most {MAX_CHOICES} conversations in one batch", "messages")
    for key, served in (("stream", (None, False)), ("tools", (None, [])), ("n", (None, 1))):
        if obj.get(key) not in served:
            raise bad_request(f"{key} is not served on /v1/chat/completions/batch (as vLLM's)", key)
    if obj.get("stop_regex") is not None:  # the batch's route does not watch its choices' text
        raise bad_request("stop_regex is not served on /v1/chat/completions/batch", "stop_regex")
    requests = []
    for i, conversation in enumerate(conversations):
        try:
            requests.append(chat_request_of({**obj, "messages": conversation}))
        except APIError as err:  # a conversation's own error names it
            if err.param is not None and err.param.startswith("messages"):
                err.param = f"messages[{i}]" + err.param.removeprefix("messages")
                err.message = f"messages[{i}]" + err.message.removeprefix("messages")
            raise
    if requests[0].prompt_ids is not None:  # one prompt for every conversation would answer none of them
        raise bad_request("prompt_token_ids is not served on /v1/chat/completions/batch", "prompt_token_ids")
    return requests


def chat_request_of(obj: dict[str, Any]) -> ChatCompletionRequest:
    f = Fields(obj)
    messages, rich = read_messages(f.raw("messages"))
    settings = _CHAT_SETTINGS({k: v for k, v in obj.items() if k != "messages"})
    template = template_for_messages(settings.request.template, messages, rich)
    echo = echoed_text(settings.echo, messages, template)
    return settings.request.with_messages(messages, template, echo)


@dataclass(frozen=True)
class ChatSettings:
    """What a chat request asks besides its messages: a function of its other fields alone,
    so requests that send the same settings share one (_CHAT_SETTINGS keeps them)."""

    request: ChatCompletionRequest  # no messages; the template its fields ask (None: plain); no echo
    echo: bool  # vLLM's echo asked (its text is the final message's)


def chat_settings(obj: dict[str, Any]) -> ChatSettings:
    """The settings of a chat request's fields but `messages` (which `obj` does not hold)."""
    f = Fields(obj)
    model = f.get_str("model")
    stream, include_usage, continuous_usage = read_stream(f)
    n = read_n(f, prompts=1)
    max_completion_tokens = f.get_int("max_completion_tokens")  # OpenAI's newer name wins
    max_tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = f.get_int("max_tokens")  # type-checked either way
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    tools, tool_choice = read_tools(f)
    template = read_template_args(f, tools)
    names = {"max_tokens": max_tokens_param}
    parallel_tool_calls = f.get_bool("parallel_tool_calls", True)
    return_token_ids = f.get_bool("return_token_ids", False)
    tokens_as_ids = f.get_bool("return_tokens_as_token_ids")
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        return_ids=return_token_ids,
        **read_logprob_token_ids(f, f.get_bool("logprobs", False), read_logprobs_count(f, "top_logprobs") or 0),
        allowed_token_ids=read_allowed_token_ids(f),
        prompt_logprobs=read_prompt_logprobs(f),
        **read_grammar(f, names, forced=forced_call_schema_of(tools, tool_choice, parallel_tool_calls)),
    )
    sglang_no_stop_trim(f, values)
    request_id = read_request_id(f)
    truncation = read_truncation(f)
    echo = f.get_bool("echo", False)
    include_reasoning = f.get_bool("include_reasoning", True)
    separate_reasoning = f.get_bool("separate_reasoning", True)
    thinking_budget = read_thinking_budget(f, names)
    stop_regex = read_stop_regex(f)
    beam = read_beam_search(f, n, stream)
    prompt_ids, prompt_param = read_pretokenized(f)
    refuse_unserved(f, REFUSED_CHAT)
    check_ignored(f)
    f.warn_unknown("/v1/chat/completions")
    sampling = SamplingSpec.build(values, max_tokens, names, prompt_param)
    request = ChatCompletionRequest(
        model,
        [],
        template,
        n,
        stream,
        include_usage,
        sampling,
        tools,
        tool_choice,
        parallel_tool_calls,
        request_id,
        continuous_usage,
        include_reasoning,
        separate_reasoning,
        truncation,
        return_token_ids,
        prompt_ids,
        "",
        tokens_as_ids,
        thinking_budget,
        stop_regex,
        beam,
    )
    return ChatSettings(request, echo)


_CHAT_SETTINGS = ParseMemo(chat_settings, MEMO_BYTES)


def read_pretokenized(f: Fields) -> tuple[tuple[int, ...] | None, str]:
    """vLLM's pre-tokenized chat prompt and the field that named it ("messages" when there is
    none): a router, or disaggregated serving's decode stage, sends the ids it already has in
    `prompt_token_ids`, or in the older `kv_transfer_params: {"prompt_token_ids"}`; the ids
    are then the prompt, verbatim. kv_transfer_params' other keys ask for a KV transfer between
    servers, which this one does not do."""
    param, given = f.param("prompt_token_ids"), f.obj.get("prompt_token_ids") is not None
    ids = f.get_token_ids("prompt_token_ids")
    transfer = f.get_object("kv_transfer_params")
    if transfer is not None:
        for key in transfer.present(transfer.obj.keys() - {"prompt_token_ids"}):
            if transfer.obj[key] is not None:
                raise bad_request(
                    f"{transfer.param(key)}: disaggregated serving (a KV transfer) is not supported; of "
                    "kv_transfer_params only prompt_token_ids is served",
                    f.param("kv_transfer_params"),
                )
        if transfer.obj.get("prompt_token_ids") is not None:
            if given:
                raise bad_request(f"give the prompt's ids once: {param} or kv_transfer_params", param)
            param, given = transfer.param("prompt_token_ids"), True
            ids = transfer.get_token_ids("prompt_token_ids")
    if not given:
        return None, "messages"
    if not ids:
        raise bad_request(f"{param} must not be empty", param)
    return ids, param


def read_thinking_budget(f: Fields, names: dict[str, str]) -> int:
    """vLLM's thinking_token_budget: -1 (or absent) for no bound, else a token count; the
    reasoning's end is then forced by the sampler, which cannot also hold the answer to a grammar."""
    budget = f.get_int("thinking_token_budget", -1)
    if budget < -1:
        raise bad_request("thinking_token_budget must be -1 (no bound) or a token count", "thinking_token_budget")
    if budget >= 0 and "grammar" in names:
        raise bad_request(
            f"thinking_token_budget cannot be combined with a grammar ({names['grammar']}): the reasoning's "
            "forced end would break it",
            "thinking_token_budget",
        )
    return budget


def echoed_text(echo: bool, messages: list[dict[str, Any]], template: ChatTemplateArgs | None) -> str:
    """vLLM's chat echo: the final message's content when its role is the answer's (the
    assistant's, or with add_generation_prompt false, that message's own), else nothing."""
    add_generation_prompt = template is None or template.add_generation_prompt
    if not echo or (add_generation_prompt and messages[-1]["role"] != "assistant"):
        return ""
    return messages[-1]["content"]


def read_messages(value: Any) -> tuple[list[dict[str, Any]], bool]:
    """The messages as the chat template reads them, and whether any has tool calls or answers
    one (then the chat renders through apply_chat_template)."""
    if type(value) is not list or not value:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    messages, rich = [], False
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if type(message) is not dict:
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if type(role) is not str or not CUSTOM_ROLE.fullmatch(role):
            raise bad_request(
                f"{where}.role must be a role name (system, developer, user, assistant, tool, or another the chat "
                f"template renders: a letter, then up to 63 of A-Z, a-z, 0-9, _ . -), not {shown(role)}",
                f"{where}.role",
            )
        out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), role, f"{where}.content")}
        for key in ("name", "tool_call_id"):
            text = message.get(key)
            if text is not None:
                if type(text) is not str:
                    raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
                out[key] = text
                rich |= key == "tool_call_id"
        calls = message.get("tool_calls")
        if calls and role == "assistant":  # an empty list, as some clients send, is no call
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
            rich = True
        elif calls is not None and calls != []:
            raise bad_request(f"{where}.tool_calls: only an assistant's message calls tools", f"{where}.tool_calls")
        messages.append(out)
    return messages, rich


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's tool_calls ([{id, type: "function", function: {name, arguments}}]) with
    their arguments (a JSON object's text) parsed: HF chat templates write them with `tojson`,
    as vLLM passes them."""
    if type(value) is not list:
        raise bad_request(f"{where} must be a list of tool calls", where)
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if type(call) is dict else None
        if type(function) is not dict or call.get("type", "function") != "function":
            raise bad_request(f'{at} must be like {{"type": "function", "function": {{"name", "arguments"}}}}', at)
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if type(name) is not str or not name:
            raise bad_request(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
        if call_id is not None and type(call_id) is not str:
            raise bad_request(f"{at}.id must be a string", f"{at}.id")
        try:
            parsed = orjson.loads(arguments) if type(arguments) is str else None
        except orjson.JSONDecodeError:
            parsed = None
        if type(parsed) is not dict:
            raise bad_request(f"{at}.function.arguments must be the JSON text of an object", f"{at}.function.arguments")
        out = {"type": "function", "function": {"name": name, "arguments": parsed}}
        if call_id is not None:
            out["id"] = call_id
        calls.append(out)
    return calls


def _content(value: Any, role: str, where: str) -> str:
    """A message's content as one string: text parts (and an assistant's refusal parts) are
    joined by newlines, as vLLM does."""
    if type(value) is str:
        return value
    if value is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    return text_parts(value, role, where)


def text_parts(value: Any, role: str, where: str, text_kinds: tuple[str, ...] = ("text",)) -> str:
    """A list of content parts of `text_kinds` (and an assistant's refusal parts), their texts
    joined by newlines; a media part is a 400 naming it (a text-only model)."""
    if type(value) is not list:
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if type(part) is dict else None
        if kind in MEDIA_PARTS:
            raise bad_request(
                f"{where}[{j}] is a {kind!r} part: this server runs a text-only model, "
                f"so only text content parts are supported",
                f"{where}[{j}].type",
            )
        refusal = kind == "refusal" and role == "assistant"  # OpenAI's assistant parts
        if not (refusal or kind in text_kinds):
            raise bad_request(
                f'{where}[{j}] must be a content part like {{"type": "{text_kinds[0]}", "text": "..."}}',
                f"{where}[{j}]",
            )
        key = "refusal" if refusal else "text"
        text = part.get(key)
        if type(text) is not str:
            raise bad_request(f"{where}[{j}].{key} must be a string", f"{where}[{j}].{key}")
        texts.append(text)
    return "\n".join(texts)


def read_tools(f: Fields) -> tuple[tuple[Tool, ...], ToolChoice]:
    """tools and tool_choice as OpenAI validates them (structured/tools.py); function_call, their
    deprecated twin, may only ask for no forced call."""
    try:
        tools = parse_tools(f.raw("tools"))
        choice = parse_tool_choice(f.raw("tool_choice"), tools)
    except InvalidTool as e:
        raise bad_request(str(e), e.param) from None
    function_call = f.raw("function_call")
    if function_call is not None and function_call not in NO_FUNCTION_CALL:
        raise bad_request(
            f"function_call {shown(function_call)} is not supported: use tools and tool_choice", "function_call"
        )
    return tools, choice


def forced_call_schema_of(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True) -> str | None:
    """The JSON schema a forced call's output must match (tool_choice "required" or a named
    function), or None; parallel_tool_calls false allows one call."""
    try:
        return forced_call_schema(tools, choice, max_calls=None if parallel else 1)
    except InvalidTool as e:
        raise bad_request(str(e), e.param) from None


def read_template_args(f: Fields, tools: tuple[Tool, ...]) -> ChatTemplateArgs | None:
    """The chat template's arguments the fields ask for (None: none, the plain render unless the
    messages need the template: template_for_messages decides)."""
    continue_final_message = f.get_bool("continue_final_message", False)
    # SGLang's: continuing the final message prefills the assistant's reply, whatever
    # add_generation_prompt says (its default is true; vLLM refuses the two together)
    add_generation_prompt = f.get_bool("add_generation_prompt", True) and not continue_final_message
    add_special_tokens = f.get_bool("add_special_tokens", False)
    documents = f.raw("documents")
    if documents is not None and not (
        type(documents) is list and all(type(d) is dict and all(type(v) is str for v in d.values()) for d in documents)
    ):
        raise bad_request(
            'documents must be a list of objects of strings, like {"title": ..., "text": ...}', "documents"
        )
    kwargs = template_kwargs(f)
    effort = f.get_str("reasoning_effort", choices=REASONING_EFFORTS)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)  # templates of reasoning models read it
    if documents and len(orjson.dumps(documents)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise bad_request(f"documents must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON", "documents")
    if not (tools or documents or kwargs or not add_generation_prompt or add_special_tokens):
        return None  # continue_final_message needs add_generation_prompt false: covered
    return ChatTemplateArgs(
        add_generation_prompt,
        continue_final_message,
        template_tools(tools),
        documents or None,
        kwargs,
        add_special_tokens,
    )


def template_for_messages(
    args: ChatTemplateArgs | None, messages: list[dict[str, Any]], rich: bool
) -> ChatTemplateArgs | None:
    """The template's arguments for these messages: read_template_args' `args`, or the defaults
    where the messages need the template (`rich`: tool calls or answers); None: the plain render."""
    if args is None:
        return ChatTemplateArgs() if rich else None
    if args.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's, which it continues",
            "continue_final_message",
        )
    return args


def template_tools(tools: tuple[Tool, ...]) -> list[dict] | None:
    """The tools as HF chat templates read them (OpenAI's chat shape); None for none."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.parameters,
            },
        }
        for t in tools
    ] or None


def template_kwargs(f: Fields) -> dict[str, Any]:
    """chat_template_kwargs: variables for the template, bounded; none may be one of the call's
    own arguments (each has its field)."""
    kwargs = f.get_object("chat_template_kwargs")
    if kwargs is None or not kwargs.obj:
        return {}
    param = "chat_template_kwargs"
    clash = sorted(TEMPLATE_CALL_ARGS.intersection(kwargs.obj))
    if clash:
        raise bad_request(
            f"{param} must not set {clash}: they are the template call's own arguments (use the request's fields)",
            param,
        )
    if len(orjson.dumps(kwargs.obj)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise bad_request(f"{param} must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON", param)
    return dict(kwargs.obj)
