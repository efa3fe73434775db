"""Request bodies (bytes) -> typed requests: one parser per endpoint, each raising
APIError(400) that names the offending field.

What a route does with a generation request:
    req = parse_chat_completion(body)                  # or parse_completion / parse_generate
    check_model(req.model, served_model_names)         # httpapi.info, 404
    prompt_ids = <tokenize: chat template, text, or the ids as given>
    params = req.sampling.resolve(prompt_ids, context_len, vocab_size)   # 400s that need the prompt
Choices are numbered prompt-major: choice i * n + j is the j-th sample of prompts[i].
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from httpapi.errors import bad_request
from httpapi.fields import Fields, is_token_ids, load_object
from httpapi.sampling import SamplingSpec, read_sampling
from protocol.sampling_params import GrammarKind
from structured.grammars import (
    JSON_OBJECT_SCHEMA,
    InvalidGrammar,
    choice_grammar,
    json_schema_text,
    structural_tag_text,
)
from structured.tools import InvalidTool, Tool, ToolChoice, forced_call_schema, parse_tool_choice, parse_tools

MAX_CHOICES = 128  # n times the number of prompts in one request
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is what the context leaves)
GENERATE_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file", "input_file")
# Fields that change no output, in vLLM and SGLang either (tests/server/test_request_fields.py says why
# for each): type-checked, then unused.
IGNORED_STRS = ("user", "service_tier", "session_id", "prompt_cache_key", "safety_identifier", "verbosity")
IGNORED_BOOLS = ("store", "return_token_offsets")
IGNORED_OBJECTS = ("metadata", "prediction")
IGNORED_NUMBERS = ("length_penalty", "routed_experts_prompt_start")  # beam search's; MoE routing data's
# vLLM's and OpenAI's fields this server does not serve: field -> why. A value is refused unless
# it asks for nothing (null, false, 0, an empty list or object, or the value in NOTHING_ASKED).
REFUSED_OPENAI = {
    "use_beam_search": "beam search is not supported",
    "truncate_prompt_tokens": "prompt truncation is not supported: send a shorter prompt",
    "truncation_side": "prompt truncation is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported; logit_bias is",
    "bad_words": "bad_words is not supported",
    "logprob_token_ids": "logprobs of chosen token ids are not supported; top_logprobs is",
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "return_token_ids": "return_token_ids is not supported",
    "return_prompt_text": "return_prompt_text is not supported",
    "cache_salt": "cache_salt is not supported: this server's prefix cache is shared by all requests",
    "kv_transfer_params": "disaggregated serving (kv_transfer_params) is not supported",
    "ec_transfer_params": "disaggregated serving (ec_transfer_params) is not supported",
    "vllm_xargs": "vllm_xargs (custom extensions) is not supported",
    "repetition_detection": "repetition_detection is not supported",
    "thinking_token_budget": "thinking_token_budget is not supported",
    "stream_interval": "a per-request stream_interval is not supported; the server's --stream-interval applies",
    "priority": "priority scheduling is not supported",
    "mm_processor_kwargs": "this server runs a text-only model",
    "media_io_kwargs": "this server runs a text-only model",
    "prompt_embeds": "prompt embeddings are not supported: send text or token ids",
    "audio": "this server runs a text-only model: no audio output",
    "web_search_options": "web search is not supported",
    "watermarking": "watermarking is not supported",
    "functions": "the deprecated functions are not supported: use tools",
    "guided_whitespace_pattern": (
        "a whitespace pattern is not supported; the server's --constrained-json-any-whitespace applies"
    ),
    "chat_template": (
        "a per-request chat_template is not supported: a client's Jinja template would run in the "
        "server; the model's template (or the server's --chat-template) applies"
    ),
    "echo": "chat echo is not supported",
    "best_of": "best_of is not supported; use n",
    "include_reasoning": "include_reasoning false is not supported",
    "separate_reasoning": "separate_reasoning false is not supported: the server's --reasoning-parser applies",
    "stream_reasoning": "stream_reasoning false is not supported: reasoning is streamed as it comes",
    "return_hidden_states": "hidden states are not returned by this server",
    "modalities": "this server runs a text-only model: only the text modality",
}
ASK_NOTHING = (False, 0, "", [], {})  # a refused field's values that ask for nothing, but for:
NOTHING_ASKED: dict[str, tuple] = {
    "best_of": (1,),
    "thinking_token_budget": (-1,),
    "include_reasoning": (True,),
    "separate_reasoning": (True,),  # SGLang's defaults, which sglang-router sends with every chat
    "stream_reasoning": (True,),
    "modalities": (["text"],),
}
# tool_choice's deprecated twin: values that ask for no call
NO_FUNCTION_CALL = ("none", "auto")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
GUIDED_BACKENDS = ("auto", "xgrammar")  # guided_decoding_backend values this server serves
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
MAX_REQUEST_ID_CHARS = 256
# a client's name for its request: visible ASCII only (it is echoed in a header, and logged)
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")

Prompt = str | list  # text, or a list of token ids

# SamplingParams.validate()'s parameter names -> /generate's fields
GENERATE_NAMES = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "top_logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    "prompt_logprobs_start": "logprob_start_len",
    "logit_bias": "sampling_params.logit_bias",
    **{
        name: "sampling_params." + name
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "stop",
            "stop_token_ids",
        )
    },
}


REFUSED_GENERATE = {
    "input_embeds": "input embeddings are not supported: send text or input_ids",
    **dict.fromkeys(
        (
            "image_data",
            "video_data",
            "audio_data",
            "use_audio_in_video",
            "modalities",
            "need_wait_for_mm_inputs",
            "num_items_assigned",
            "max_dynamic_patch",
            "min_dynamic_patch",
            "image_max_dynamic_patch",
            "video_max_dynamic_patch",
        ),
        "this server runs a text-only model",
    ),
    "token_ids_logprob": "logprobs of chosen token ids are not supported; top_logprobs_num is",
    "return_hidden_states": "hidden states are not returned by this server",
    "return_routed_experts": "routed experts are not returned by this server",
    "return_indexer_topk": "indexer top-k is not returned by this server",
    "return_entropy": "entropy is not returned by this server",
    "return_bytes": "return_bytes is not supported",
    "session_params": "sessions are not supported",
    "lora_path": "LoRA adapters are not supported",
    "lora_id": "LoRA adapters are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "positional_embed_overrides": "embedding overrides are not supported",
    **dict.fromkeys(
        ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"),
        "disaggregated serving is not supported",
    ),
    "require_reasoning": "require_reasoning is not supported",
    "background": "background requests are not supported",
    "priority": "priority scheduling is not supported",
    "extra_key": "extra_key (a cache salt) is not supported: this server's prefix cache is shared by all requests",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
}
REFUSED_SAMPLING_PARAMS = {
    "stop_regex": "stop_regex is not supported; stop strings are",
    "custom_params": "custom_params (for custom logit processors) is not supported",
    "stream_interval": "a per-request stream_interval is not supported; the server's --stream-interval applies",
}
# /generate's fields that change no output (routing, tracing, metrics): type-checked, unused
GENERATE_IGNORED = {
    "str": ("conversation_id", "routing_key"),
    "bool": ("log_metrics", "no_logs"),
    "int": ("routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "routed_experts_start_len"),
    "number": ("received_time",),
    "object": ("custom_labels", "external_trace_header"),
}
OPENAI_IGNORED = {"str": IGNORED_STRS, "bool": IGNORED_BOOLS, "number": IGNORED_NUMBERS, "object": IGNORED_OBJECTS}


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


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[Prompt, ...]
    n: int
    stream: bool
    include_usage: bool
    echo: bool  # the client sees the prompt's text before each choice's completion
    sampling: SamplingSpec
    add_special_tokens: bool = True  # a text prompt's tokens get the tokenizer's BOS and the like
    request_id: str | None = None  # the client's: the response's id is cmpl-<request_id>


@dataclass(frozen=True)
class GenerateRequest:
    """SGLang's native /generate."""

    prompts: tuple[Prompt, ...]
    rids: tuple[str | None, ...]  # one per prompt; None: the server names the request
    batch: bool  # answer with a list, as SGLang does for a list of prompts or n > 1
    n: int
    stream: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    samplings: tuple[SamplingSpec, ...]  # one per prompt (sampling_params may be a list of them)


@dataclass(frozen=True)
class TokenizeRequest:
    model: str | None
    prompts: tuple[str, ...]
    messages: list[dict[str, Any]] | None  # instead of prompts: a chat, through the chat template
    template: ChatTemplateArgs | None  # the chat's, as a chat completion's
    batch: bool
    add_special_tokens: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    token_ids: tuple[list[int], ...]
    batch: bool
    skip_special_tokens: bool


@dataclass(frozen=True)
class AbortRequest:
    rid: str | None
    abort_all: bool


def parse_chat_completion(body: bytes) -> ChatCompletionRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    messages, rich = _messages(f.raw("messages"))
    stream, include_usage = _stream(f)
    n = _n(f, prompts=1)
    max_completion_tokens = f.get_int("max_completion_tokens")  # OpenAI's newer name wins
    max_tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = f.get_int("max_tokens")  # type-checked either way
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    tools, tool_choice = _tools(f)
    template = _template_args(f, messages, tools, rich)
    names = {"max_tokens": max_tokens_param}
    parallel_tool_calls = f.get_bool("parallel_tool_calls", True)
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        logprobs=f.get_bool("logprobs", False),
        top_logprobs=f.get_int("top_logprobs", 0),
        prompt_logprobs=_prompt_logprobs(f),
        **_grammar(f, names, forced=forced_call_schema_of(tools, tool_choice, parallel_tool_calls)),
    )
    _sglang_no_stop_trim(f, values)
    request_id = _request_id(f)
    _refuse_unserved(f, REFUSED_OPENAI)
    _check_ignored(f)
    f.warn_unknown("/v1/chat/completions")
    sampling = SamplingSpec.build(values, max_tokens, names, "messages")
    return ChatCompletionRequest(
        model,
        messages,
        template,
        n,
        stream,
        include_usage,
        sampling,
        tools,
        tool_choice,
        parallel_tool_calls,
        request_id,
    )


def parse_completion(body: bytes) -> CompletionRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    prompts, _ = _prompts(f.raw("prompt"), "prompt", token_ids_allowed=True)
    stream, include_usage = _stream(f)
    n = _n(f, prompts=len(prompts))
    max_tokens = f.get_int("max_tokens", COMPLETION_MAX_TOKENS)
    echo = f.get_bool("echo", False)
    logprobs = f.get_int("logprobs")
    if f.get_str("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    prompt_logprobs = _prompt_logprobs(f)
    names = {"top_logprobs": "logprobs"}
    if prompt_logprobs < 0 and echo and logprobs is not None:  # vLLM's: the echoed prompt's logprobs too
        prompt_logprobs, names["prompt_logprobs"] = logprobs, "logprobs"
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        **_grammar(f, names),
    )
    _sglang_no_stop_trim(f, values)
    add_special_tokens = f.get_bool("add_special_tokens", True)
    request_id = _request_id(f)
    _refuse_unserved(f, {k: v for k, v in REFUSED_OPENAI.items() if k != "echo"})
    _check_ignored(f)
    f.warn_unknown("/v1/completions")
    sampling = SamplingSpec.build(values, max_tokens, names, "prompt")
    return CompletionRequest(model, prompts, n, stream, include_usage, echo, sampling, add_special_tokens, request_id)


def parse_generate(body: bytes) -> GenerateRequest:
    f = Fields(load_object(body))
    text, input_ids = f.raw("text"), f.raw("input_ids")
    if (text is None) == (input_ids is None):
        raise bad_request("Give exactly one of text or input_ids", "text")
    prompt_param = "text" if text is not None else "input_ids"
    prompts, batch = _prompts(
        text if text is not None else input_ids,
        prompt_param,
        token_ids_allowed=input_ids is not None,
        text_allowed=text is not None,
    )
    rids = _rids(f.raw("rid"), len(prompts))
    return_logprob = f.get_bool("return_logprob", False)
    top_logprobs_num = f.get_int("top_logprobs_num", 0)  # SGLang ignores it without return_logprob
    logprob_start_len = f.get_int("logprob_start_len", -1)  # SGLang's -1: the output's logprobs only
    if logprob_start_len < -1:
        raise bad_request("logprob_start_len must be -1 (none of the prompt) or a prompt position", "logprob_start_len")
    per_prompt = [
        _generate_sampling(
            sp,
            len(prompts),
            prompt_param,
            return_logprob,
            top_logprobs_num,
            logprob_start_len if return_logprob else -1,
        )
        for sp in _sampling_objects(f.raw("sampling_params"), len(prompts))
    ]
    n = per_prompt[0][0]
    if any(k != n for k, _ in per_prompt):
        raise bad_request("sampling_params: every prompt's n must be the same", "sampling_params")
    samplings = tuple(spec for _, spec in per_prompt) * (len(prompts) if len(per_prompt) == 1 else 1)
    _refuse_unserved(f, REFUSED_GENERATE)
    stream = f.get_bool("stream", False)
    return_text = f.get_bool("return_text_in_logprobs", False)
    _check_ignored(f, GENERATE_IGNORED)
    f.ignore("sampling_params")
    f.warn_unknown("/generate")
    return GenerateRequest(prompts, rids, batch or n > 1, n, stream, return_logprob, return_text, samplings)


def _sampling_objects(value: Any, n_prompts: int) -> list[Fields]:
    """/generate's sampling_params: one object for every prompt, or a list with one per prompt."""
    if value is None or type(value) is dict:
        return [Fields(value or {}, "sampling_params.")]
    if type(value) is list and len(value) == n_prompts and all(type(v) is dict for v in value):
        return [Fields(v, f"sampling_params[{i}].") for i, v in enumerate(value)]
    raise bad_request("sampling_params must be an object, or a list of objects with one per prompt", "sampling_params")


def _generate_sampling(
    sp: Fields, n_prompts: int, prompt_param: str, return_logprob: bool, top_logprobs_num: int, logprob_start_len: int
) -> tuple[int, SamplingSpec]:
    """(n, the sampling) of one sampling_params object of /generate. logprob_start_len >= 0:
    the prompt's logprobs from there, with top_logprobs_num alternatives (SGLang's)."""
    n = _n(sp, prompts=n_prompts)
    max_new_tokens = sp.get_int("max_new_tokens", GENERATE_MAX_NEW_TOKENS)
    names = {k: v.replace("sampling_params.", sp.prefix) for k, v in GENERATE_NAMES.items()}
    grammar = _one_grammar(
        [
            (sp.param(key), kind, lambda key=key, read=read: read(sp.raw(key)))
            for key, kind, read in (
                ("json_schema", GrammarKind.JSON_SCHEMA, json_schema_text),
                ("regex", GrammarKind.REGEX, _text),
                ("ebnf", GrammarKind.EBNF, _text),
                ("structural_tag", GrammarKind.STRUCTURAL_TAG, structural_tag_text),
            )
            if sp.raw(key) is not None
        ],
        names,
    )
    values = read_sampling(
        sp,
        seed="sampling_seed",
        min_tokens="min_new_tokens",
        no_stop_trim="no_stop_trim",
        return_ids=True,  # SGLang's /generate answers output_ids
        logprobs=return_logprob,
        top_logprobs=top_logprobs_num if return_logprob else 0,
        prompt_logprobs=top_logprobs_num if logprob_start_len >= 0 else -1,
        prompt_logprobs_start=max(logprob_start_len, 0),
        **grammar,
    )
    _refuse_unserved(sp, REFUSED_SAMPLING_PARAMS)
    sp.warn_unknown("/generate")
    return n, SamplingSpec.build(values, max_new_tokens, names, prompt_param)


def parse_tokenize(body: bytes) -> TokenizeRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    if (f.raw("prompt") is None) == (f.raw("messages") is None):
        raise bad_request("Give exactly one of prompt or messages", "prompt")
    prompts, messages, template, batch = (), None, None, False
    if f.raw("messages") is not None:  # vLLM's chat fields of /tokenize: a chat completion's
        messages, rich = _messages(f.raw("messages"))
        tools, _ = _tools(f)
        template = _template_args(f, messages, tools, rich)
        add_special_tokens = template.add_special_tokens if template is not None else False
    else:
        prompts, batch = _prompts(f.raw("prompt"), "prompt", token_ids_allowed=False, empty_allowed=True)
        add_special_tokens = f.get_bool("add_special_tokens", True)
    f.warn_unknown("/tokenize")
    return TokenizeRequest(model, prompts, messages, template, batch, add_special_tokens)


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    tokens = f.raw("tokens")
    if is_token_ids(tokens):
        token_ids, batch = (tokens,), False
    elif type(tokens) is list and tokens and all(is_token_ids(t) for t in tokens):
        token_ids, batch = tuple(tokens), True
    else:
        raise bad_request("tokens must be a list of token ids or a non-empty list of lists of token ids", "tokens")
    skip_special_tokens = f.get_bool("skip_special_tokens", True)  # SGLang's default
    f.warn_unknown("/detokenize")
    return DetokenizeRequest(model, token_ids, batch, skip_special_tokens)


def parse_abort(body: bytes) -> AbortRequest:
    f = Fields(load_object(body))
    rid = f.get_str("rid") or None
    abort_all = f.get_bool("abort_all", False)
    if rid is None and not abort_all:
        raise bad_request("Give the rid of the request to abort, or abort_all: true", "rid")
    f.warn_unknown("/abort_request")
    return AbortRequest(rid, abort_all)


def _messages(value: Any) -> tuple[list[dict[str, Any]], bool]:
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
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {list(ROLES)}, not {role!r}", f"{where}.role")
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
    if type(value) is not list:
        raise bad_request(f"{where} must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if type(part) is dict else None
        if kind in MEDIA_PARTS:
            raise bad_request(
                f"{where}[{j}] is a {kind!r} part: this server runs a text-only model, "
                f"so only 'text' content parts are supported",
                f"{where}[{j}].type",
            )
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"  # OpenAI's assistant parts
        if kind != key:
            raise bad_request(
                f'{where}[{j}] must be a content part like {{"type": "text", "text": "..."}}', f"{where}[{j}]"
            )
        text = part.get(key)
        if type(text) is not str:
            raise bad_request(f"{where}[{j}].{key} must be a string", f"{where}[{j}].{key}")
        texts.append(text)
    return "\n".join(texts)


def _prompts(
    value: Any, param: str, *, token_ids_allowed: bool, text_allowed: bool = True, empty_allowed: bool = False
) -> tuple[tuple[Prompt, ...], bool]:
    """A string, a list of strings, a list of token ids or a list of lists of token ids ->
    (prompts, whether the client sent a batch)."""
    if text_allowed and type(value) is str:
        prompts, batch = (value,), False
    elif type(value) is list and value and text_allowed and all(type(p) is str for p in value):
        prompts, batch = tuple(value), True
    elif token_ids_allowed and is_token_ids(value) and value:
        prompts, batch = (value,), False
    elif token_ids_allowed and type(value) is list and value and all(is_token_ids(p) for p in value):
        prompts, batch = tuple(value), True
    else:
        kinds = (["a string", "a list of strings"] if text_allowed else []) + (
            ["a list of token ids", "a list of lists of token ids"] if token_ids_allowed else []
        )
        raise bad_request(f"{param} must be {', '.join(kinds[:-1])} or {kinds[-1]}", param)
    if not empty_allowed and not all(prompts):
        raise bad_request(f"{param} must not be empty", param)
    return prompts, batch


def _rids(value: Any, n_prompts: int) -> tuple[str | None, ...]:
    if value is None:
        return (None,) * n_prompts
    if type(value) is str:  # a batch's prompts are <rid>_0, <rid>_1, ... as SGLang names them
        return (value,) if n_prompts == 1 else tuple(f"{value}_{i}" for i in range(n_prompts))
    if type(value) is list and len(value) == n_prompts and all(type(r) is str for r in value):
        if len(set(value)) < n_prompts:  # /abort_request names one request by its rid
            raise bad_request("rid must not repeat: each prompt's request needs its own rid", "rid")
        return tuple(value)
    raise bad_request("rid must be a string, or a list of strings with one per prompt", "rid")


def _stream(f: Fields) -> tuple[bool, bool]:
    stream = f.get_bool("stream", False)
    options = f.get_object("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.get_bool("include_usage", False)
    options.ignore("continuous_usage_stats")
    return stream, include_usage


def _n(f: Fields, prompts: int) -> int:
    n = f.get_int("n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"{f.param('n')} must be between 1 and {MAX_CHOICES}", f.param("n"))
    if n * prompts > MAX_CHOICES:
        raise bad_request(
            f"{f.param('n')} times the number of prompts ({n} x {prompts}) must be at most {MAX_CHOICES}", f.param("n")
        )
    return n


def _tools(f: Fields) -> tuple[tuple[Tool, ...], ToolChoice]:
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
            f"function_call {_short(function_call)} is not supported: use tools and tool_choice", "function_call"
        )
    return tools, choice


def forced_call_schema_of(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = True) -> str | None:
    """The JSON schema a forced call's output must match (tool_choice "required" or a named
    function), or None; parallel_tool_calls false allows one call."""
    try:
        return forced_call_schema(tools, choice, max_calls=None if parallel else 1)
    except InvalidTool as e:
        raise bad_request(str(e), e.param) from None


def _template_args(
    f: Fields, messages: list[dict[str, Any]], tools: tuple[Tool, ...], rich: bool
) -> ChatTemplateArgs | None:
    add_generation_prompt = f.get_bool("add_generation_prompt", True)
    continue_final_message = f.get_bool("continue_final_message", False)
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
            "to false to continue the final message",
            "continue_final_message",
        )
    if continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be the assistant's, which it continues",
            "continue_final_message",
        )
    add_special_tokens = f.get_bool("add_special_tokens", False)
    documents = f.raw("documents")
    if documents is not None and not (
        type(documents) is list and all(type(d) is dict and all(type(v) is str for v in d.values()) for d in documents)
    ):
        raise bad_request(
            'documents must be a list of objects of strings, like {"title": ..., "text": ...}', "documents"
        )
    kwargs = _template_kwargs(f)
    effort = f.get_str("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}", "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)  # templates of reasoning models read it
    if documents and len(orjson.dumps(documents)) > MAX_TEMPLATE_KWARGS_BYTES:
        raise bad_request(f"documents must be at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON", "documents")
    if not (rich or tools or documents or kwargs or not add_generation_prompt or add_special_tokens):
        return None  # continue_final_message needs add_generation_prompt false: covered
    template_tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.parameters,
            },
        }
        for t in tools
    ]
    return ChatTemplateArgs(
        add_generation_prompt,
        continue_final_message,
        template_tools or None,
        documents or None,
        kwargs,
        add_special_tokens,
    )


def _template_kwargs(f: Fields) -> dict[str, Any]:
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


def _prompt_logprobs(f: Fields) -> int:
    """vLLM's prompt_logprobs: each prompt token's logprob and this many alternatives; -1: none."""
    k = f.get_int("prompt_logprobs")
    if k is None:
        return -1
    if k < 0:
        raise bad_request(
            "prompt_logprobs must be between 0 and 20 (-1, the whole vocabulary, is not supported)", "prompt_logprobs"
        )
    return k


def _grammar(f: Fields, names: dict[str, str], forced: str | None = None) -> dict[str, Any]:
    """The grammar OpenAI's and vLLM's fields ask for, as read_sampling's grammar_kind and
    grammar (none: {}); at most one source. `forced`: a forced tool call's schema. Sets
    names["grammar"] to its field, and names["compact_json"] to the field that demands JSON
    without whitespace, if one does."""
    candidates: list[tuple[str, GrammarKind, Any]] = []
    if forced is not None:
        candidates.append(("tools", GrammarKind.JSON_SCHEMA, lambda: json_schema_text(forced)))
    candidates += _response_format(f)
    so = f.get_object("structured_outputs")
    if so is not None:
        candidates += _guided(so, ("json", "regex", "choice", "grammar", "structural_tag"))
        if so.get_bool("json_object", False):
            candidates.append((so.param("json_object"), GrammarKind.JSON_SCHEMA, lambda: JSON_OBJECT_SCHEMA))
        if so.get_bool("disable_any_whitespace", False):
            names["compact_json"] = so.param("disable_any_whitespace")
        so.get_bool("disable_additional_properties", False)  # xgrammar's strict mode refuses them already
        so.get_bool("disable_fallback", False)  # one backend: nothing to fall back to
        _refuse_unserved(so, {"whitespace_pattern": REFUSED_OPENAI["guided_whitespace_pattern"]})
        so.warn_unknown("structured_outputs")
    candidates += _guided(f, ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag"))
    backend = f.get_str("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not served: this server's grammars are xgrammar's "
            f"(one of {list(GUIDED_BACKENDS)})",
            "guided_decoding_backend",
        )
    return _one_grammar(candidates, names)


def _guided(f: Fields, keys: tuple[str, ...]) -> list[tuple[str, GrammarKind, Any]]:
    """vLLM's grammar fields (json, regex, choice, grammar, structural_tag, or their guided_
    names) that `f` has."""
    kinds = {
        "json": (GrammarKind.JSON_SCHEMA, json_schema_text),
        "regex": (GrammarKind.REGEX, _text),
        "choice": (GrammarKind.EBNF, choice_grammar),
        "grammar": (GrammarKind.EBNF, _text),
        "structural_tag": (GrammarKind.STRUCTURAL_TAG, structural_tag_text),
    }
    found = []
    for key in keys:
        value = f.raw(key)
        if value is not None:
            kind, read = kinds[key.removeprefix("guided_")]
            found.append((f.param(key), kind, lambda read=read, value=value: read(value)))
    return found


def _response_format(f: Fields) -> list[tuple[str, GrammarKind, Any]]:
    rf = f.get_object("response_format")
    if rf is None:
        return []
    kind = rf.get_str("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", GrammarKind.JSON_SCHEMA, lambda: JSON_OBJECT_SCHEMA)]
    if kind == "json_schema":
        js = rf.get_object("json_schema")
        if js is None:
            raise bad_request(
                'response_format of type "json_schema" needs json_schema: {"name", "schema"}',
                "response_format.json_schema",
            )
        if not js.get_str("name"):
            raise bad_request("response_format.json_schema.name is required", "response_format.json_schema.name")
        js.get_str("description")
        js.get_bool("strict", False)
        schema = js.raw("schema")
        if type(schema) is not dict:
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object", "response_format.json_schema.schema"
            )
        js.warn_unknown("response_format")
        return [("response_format.json_schema.schema", GrammarKind.JSON_SCHEMA, lambda: json_schema_text(schema))]
    if kind == "structural_tag":
        rf.ignore(*rf.obj)
        return [("response_format", GrammarKind.STRUCTURAL_TAG, lambda: structural_tag_text(rf.obj))]
    raise bad_request(
        f"response_format.type must be one of text, json_object, json_schema and structural_tag, not {_short(kind)}",
        "response_format.type",
    )


def _one_grammar(candidates: list[tuple[str, GrammarKind, Any]], names: dict[str, str]) -> dict[str, Any]:
    """The one grammar of `candidates` ((field, kind, its text's maker)) as read_sampling's values;
    a second is a 400 naming it, a text that cannot be a grammar one naming its field."""
    if not candidates:
        return {}
    (param, kind, make), *others = candidates
    if others:
        raise bad_request(f"{others[0][0]}: a request may ask for one grammar, and {param} asks for one", others[0][0])
    try:
        text = make()
    except InvalidGrammar as e:
        raise bad_request(f"{param} is not a valid grammar: {e.message}", param) from None
    names["grammar"] = param
    return {"grammar_kind": kind, "grammar": text}


def _text(value: Any) -> str:
    if type(value) is not str or not value:
        raise InvalidGrammar("it must be a non-empty string")
    return value


def _refuse_unserved(f: Fields, refused: dict[str, str]) -> None:
    """A field this server does not serve is a 400 naming it, unless its value asks for nothing
    (null, or its NOTHING_ASKED values, else false, 0, "", [] or {}): then it changes nothing."""
    for key, why in refused.items():
        value = f.obj.get(key)
        if value is None:
            continue
        f.read.add(key)
        if not any(type(value) is type(v) and value == v for v in NOTHING_ASKED.get(key, ASK_NOTHING)):
            raise bad_request(f"{f.param(key)}: {why}", f.param(key))


def _check_ignored(f: Fields, table: dict[str, tuple[str, ...]] = OPENAI_IGNORED) -> None:
    """Fields that change no output get their types checked, as vLLM and SGLang check them."""
    read = {"str": f.get_str, "bool": lambda k: f.get_bool(k, False), "int": f.get_int, "number": f.get_float}
    for kind, keys in table.items():
        for key in keys:
            if kind == "object":
                f.get_object(key)
            else:
                read[kind](key)


def _sglang_no_stop_trim(f: Fields, values: dict[str, Any]) -> None:
    """SGLang's name on its OpenAI routes for vLLM's include_stop_str_in_output: either keeps the stop."""
    values["no_stop_trim"] = f.get_bool("no_stop_trim", False) or values["no_stop_trim"]


def _request_id(f: Fields) -> str | None:
    request_id = f.get_str("request_id")
    return None if request_id is None else check_request_id(request_id, "request_id")


def check_request_id(value: str, param: str) -> str:
    """A client's name for its request, as the body's request_id or the x-request-id header
    (`param`): 1 to MAX_REQUEST_ID_CHARS visible ASCII characters, else a 400 naming `param`."""
    if _REQUEST_ID.fullmatch(value) is None:
        raise bad_request(
            f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters (no spaces), not {_short(value)}",
            param,
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
