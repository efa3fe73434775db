"""Request bodies (bytes) -> typed requests: one parser per endpoint, each raising
APIError(400) that names the offending field.

What a route does with a generation request:
    req = parse_chat_completion(body)                  # or parse_completion / parse_generate
    check_model(req.model, served_model_name)          # httpapi.info, 404
    prompt_ids = <tokenize: chat template, text, or the ids as given>
    params = req.sampling.resolve(prompt_ids, context_len, vocab_size)   # 400s that need the prompt
Choices are numbered prompt-major: choice i * n + j is the j-th sample of prompts[i].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from httpapi.errors import bad_request
from httpapi.fields import Fields, is_token_ids, load_object
from httpapi.sampling import SamplingSpec, read_sampling

MAX_CHOICES = 128  # n times the number of prompts in one request
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is what the context leaves)
GENERATE_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
ROLES = ("system", "developer", "user", "assistant", "tool")
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file", "input_file")
# Fields of the OpenAI API that change nothing here: type-checked as OpenAI does, then unused.
IGNORED_STRS, IGNORED_BOOLS, IGNORED_OBJECTS = ("user", "service_tier"), ("store", "parallel_tool_calls"), ("metadata",)
# tool_choice / function_call values that ask for no call, or leave it to a model that has no tools
NO_FORCED_CALL = (None, "none", "auto")

Prompt = str | list  # text, or a list of token ids

# SamplingParams.validate()'s parameter names -> /generate's fields
GENERATE_NAMES = {
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "top_logprobs": "top_logprobs_num",
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


@dataclass(frozen=True)
class ChatCompletionRequest:
    model: str | None
    messages: list[dict[str, str]]  # {"role", "content"[, "name"]}, ready for apply_chat_template
    n: int
    stream: bool
    include_usage: bool
    sampling: SamplingSpec


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[Prompt, ...]
    n: int
    stream: bool
    include_usage: bool
    echo: bool  # the client sees the prompt's text before each choice's completion
    sampling: SamplingSpec


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
    messages: list[dict[str, str]] | None  # instead of prompts: a chat, through the chat template
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
    messages = _messages(f.raw("messages"))
    stream, include_usage = _stream(f)
    n = _n(f, prompts=1)
    max_completion_tokens = f.get_int("max_completion_tokens")  # OpenAI's newer name wins
    max_tokens_param = "max_tokens" if max_completion_tokens is None else "max_completion_tokens"
    max_tokens = f.get_int("max_tokens") if max_completion_tokens is None else max_completion_tokens
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        logprobs=f.get_bool("logprobs", False),
        top_logprobs=f.get_int("top_logprobs", 0),
    )
    _reject_unsupported_openai(f)
    f.warn_unknown("/v1/chat/completions")
    sampling = SamplingSpec.build(values, max_tokens, {"max_tokens": max_tokens_param}, "messages")
    return ChatCompletionRequest(model, messages, n, stream, include_usage, sampling)


def parse_completion(body: bytes) -> CompletionRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    prompts, _ = _prompts(f.raw("prompt"), "prompt", token_ids_allowed=True)
    stream, include_usage = _stream(f)
    n = _n(f, prompts=len(prompts))
    max_tokens = f.get_int("max_tokens", COMPLETION_MAX_TOKENS)
    echo = f.get_bool("echo", False)
    logprobs = f.get_int("logprobs")
    if logprobs is not None and echo:
        raise bad_request("echo with logprobs is not supported: it needs the prompt's logprobs", "echo")
    best_of = f.get_int("best_of")
    if best_of not in (None, 1):
        raise bad_request("best_of is not supported; use n", "best_of")
    if f.get_str("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )
    _reject_unsupported_openai(f)
    f.warn_unknown("/v1/completions")
    sampling = SamplingSpec.build(values, max_tokens, {"top_logprobs": "logprobs"}, "prompt")
    return CompletionRequest(model, prompts, n, stream, include_usage, echo, sampling)


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
    if f.get_int("logprob_start_len", -1) != -1 and return_logprob:
        raise bad_request("prompt logprobs are not supported; leave logprob_start_len at -1", "logprob_start_len")
    per_prompt = [
        _generate_sampling(sp, len(prompts), prompt_param, return_logprob, top_logprobs_num)
        for sp in _sampling_objects(f.raw("sampling_params"), len(prompts))
    ]
    n = per_prompt[0][0]
    if any(k != n for k, _ in per_prompt):
        raise bad_request("sampling_params: every prompt's n must be the same", "sampling_params")
    samplings = tuple(spec for _, spec in per_prompt) * (len(prompts) if len(per_prompt) == 1 else 1)
    if f.raw("token_ids_logprob") is not None:
        raise bad_request("token_ids_logprob is not supported by this server", "token_ids_logprob")
    for key in ("image_data", "audio_data", "video_data", "lora_path", "custom_logit_processor"):
        if f.raw(key) is not None:
            raise bad_request(f"{key} is not supported by this server", key)
    stream = f.get_bool("stream", False)
    return_text = f.get_bool("return_text_in_logprobs", False)
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
    sp: Fields, n_prompts: int, prompt_param: str, return_logprob: bool, top_logprobs_num: int
) -> tuple[int, SamplingSpec]:
    """(n, the sampling) of one sampling_params object of /generate."""
    n = _n(sp, prompts=n_prompts)
    max_new_tokens = sp.get_int("max_new_tokens", GENERATE_MAX_NEW_TOKENS)
    values = read_sampling(
        sp,
        seed="sampling_seed",
        min_tokens="min_new_tokens",
        no_stop_trim="no_stop_trim",
        return_ids=True,  # SGLang's /generate answers output_ids
        logprobs=return_logprob,
        top_logprobs=top_logprobs_num if return_logprob else 0,
    )
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        if sp.raw(key) is not None:
            raise bad_request(f"{sp.param(key)}: structured output is not supported", sp.param(key))
    for key in ("stop_regex", "logit_bias", "custom_params"):  # each would change the output
        if sp.raw(key):
            raise bad_request(f"{sp.param(key)} is not supported by this server", sp.param(key))
    sp.warn_unknown("/generate")
    names = {k: v.replace("sampling_params.", sp.prefix) for k, v in GENERATE_NAMES.items()}
    return n, SamplingSpec.build(values, max_new_tokens, names, prompt_param)


def parse_tokenize(body: bytes) -> TokenizeRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    if (f.raw("prompt") is None) == (f.raw("messages") is None):
        raise bad_request("Give exactly one of prompt or messages", "prompt")
    prompts, messages, batch = (), None, False
    if f.raw("messages") is not None:
        messages = _messages(f.raw("messages"))
    else:
        prompts, batch = _prompts(f.raw("prompt"), "prompt", token_ids_allowed=False, empty_allowed=True)
    add_special_tokens = f.get_bool("add_special_tokens", True)
    f.warn_unknown("/tokenize")
    return TokenizeRequest(model, prompts, messages, batch, add_special_tokens)


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


def _messages(value: Any) -> list[dict[str, str]]:
    if type(value) is not list or not value:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if type(message) is not dict:
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {list(ROLES)}, not {role!r}", f"{where}.role")
        out = {"role": role, "content": _content(message.get("content"), role, f"{where}.content")}
        name = message.get("name")
        if name is not None:
            if type(name) is not str:
                raise bad_request(f"{where}.name must be a string", f"{where}.name")
            out["name"] = name
        messages.append(out)
    return messages


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


def _reject_unsupported_openai(f: Fields) -> None:
    """OpenAI features this server cannot honour get a 400, rather than being silently ignored;
    the fields it ignores get OpenAI's type checks."""
    logit_bias = f.get_object("logit_bias")
    if logit_bias is not None and logit_bias.obj:
        raise bad_request("logit_bias is not supported", "logit_bias")
    response_format = f.raw("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad_request('response_format other than {"type": "text"} is not supported', "response_format")
    tools, tool_choice = f.raw("tools"), f.raw("tool_choice")
    if tools and tool_choice != "none":
        raise bad_request("tools are not supported: this server has no tool calling", "tools")
    if f.raw("functions"):
        raise bad_request("functions are not supported: this server has no function calling", "functions")
    for key, value in (("tool_choice", tool_choice), ("function_call", f.raw("function_call"))):
        if value not in NO_FORCED_CALL:  # "required", a named function: a call this server cannot make
            raise bad_request(
                f"{key} {_short(value)} is not supported: this server has no tool calling; "
                f'leave {key} unset, "none" or "auto"',
                key,
            )
    for key in IGNORED_STRS:
        f.get_str(key)
    for key in IGNORED_BOOLS:
        f.get_bool(key, False)
    for key in IGNORED_OBJECTS:
        f.get_object(key)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
