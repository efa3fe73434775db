"""Request bodies (bytes) -> typed requests: one parser per endpoint, each raising
APIError(400) that names the offending field (the chat's: chat_request.py).

What a route does with a generation request:
    req = parse_chat_completion(body)                  # or parse_completion / parse_generate
    check_model(req.model, served_model_names)         # httpapi.info, 404
    prompt_ids = <tokenize: chat template, text, or the ids as given>
    params = req.sampling.resolve(prompt_ids, context_len, vocab_size)   # 400s that need the prompt
Choices are numbered prompt-major: choice i * n + j is the j-th sample of prompts[i].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import regex

from httpapi.chat_request import (
    ChatTemplateArgs,
    read_messages,
    read_template_args,
    read_tools,
    template_for_messages,
)
from httpapi.errors import bad_request
from httpapi.fields import Fields, is_token_ids, load_object
from httpapi.grammar_fields import SGLANG_GRAMMARS, one_grammar, read_grammar
from httpapi.request_fields import (
    REFUSED_OPENAI,
    BeamSearch,
    Prompt,
    PromptTruncation,
    check_ignored,
    ignored_fields,
    read_beam_search,
    read_logprobs_count,
    read_n,
    read_prompt_logprobs,
    read_prompts,
    read_request_id,
    read_stop_regex,
    read_stream,
    read_truncation,
    refuse_unserved,
    sglang_no_stop_trim,
)
from httpapi.sampling import SamplingSpec, read_allowed_token_ids, read_logprob_token_ids, read_sampling
from protocol.sampling_params import GrammarKind
from structured.grammars import structural_tag_text

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat's is what the context leaves)
GENERATE_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
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
    "lora_id": "LoRA adapters are named by lora_path, not by id",
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
    "stop_regex": "stop_regex is served on /v1/completions and /v1/chat/completions, not on /generate",
    "custom_params": "custom_params (for custom logit processors) is not supported",
    "stream_interval": "a per-request stream_interval is not supported; the server's --stream-interval applies",
}
# /generate's fields that change no output (routing, tracing, metrics): type-checked, unused
GENERATE_IGNORED = ignored_fields(
    {
        "str": ("conversation_id", "routing_key"),
        "bool": ("log_metrics", "no_logs"),
        "int": ("routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "routed_experts_start_len"),
        "number": ("received_time",),
        "object": ("custom_labels", "external_trace_header"),
    }
)


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
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    truncation: PromptTruncation | None = None  # vLLM's truncate_prompt_tokens
    return_token_ids: bool = False  # vLLM's: each choice's prompt_token_ids and token_ids in the answer
    tokens_as_ids: bool | None = None  # vLLM's return_tokens_as_token_ids (None: the server's default)
    stop_regex: tuple[regex.Pattern, ...] = ()  # SGLang's: a choice stops where one matches its text
    beam: BeamSearch | None = None  # vLLM's use_beam_search: n beams instead of n samples


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
    lora_paths: tuple[str | None, ...] = ()  # SGLang's lora_path, one per prompt (None: the base); () none


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


def parse_completion(body: bytes) -> CompletionRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    if f.raw("prompt") in (None, ""):  # vLLM's words, which its clients may match
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    prompts, _ = read_prompts(f.raw("prompt"), "prompt", token_ids_allowed=True)
    stream, include_usage, continuous_usage = read_stream(f)
    n = read_n(f, prompts=len(prompts))
    max_tokens = f.get_int("max_tokens", COMPLETION_MAX_TOKENS)
    echo = f.get_bool("echo", False)
    logprobs = read_logprobs_count(f, "logprobs")
    if f.get_str("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    prompt_logprobs = read_prompt_logprobs(f)
    names = {"top_logprobs": "logprobs"}
    if prompt_logprobs < 0 and echo and logprobs is not None:  # vLLM's: the echoed prompt's logprobs too
        prompt_logprobs, names["prompt_logprobs"] = logprobs, "logprobs"
    return_token_ids = f.get_bool("return_token_ids", False)
    tokens_as_ids = f.get_bool("return_tokens_as_token_ids")
    values = read_sampling(
        f,
        seed="seed",
        min_tokens="min_tokens",
        no_stop_trim="include_stop_str_in_output",
        return_ids=return_token_ids,
        **read_logprob_token_ids(f, logprobs is not None, logprobs or 0),
        allowed_token_ids=read_allowed_token_ids(f),
        prompt_logprobs=prompt_logprobs,
        **read_grammar(f, names),
    )
    sglang_no_stop_trim(f, values)
    add_special_tokens = f.get_bool("add_special_tokens", True)
    request_id = read_request_id(f)
    truncation = read_truncation(f)
    stop_regex = read_stop_regex(f)
    beam = read_beam_search(f, n, stream)
    refuse_unserved(f, REFUSED_OPENAI)
    check_ignored(f)
    f.warn_unknown("/v1/completions")
    sampling = SamplingSpec.build(values, max_tokens, names, "prompt")
    return CompletionRequest(
        model,
        prompts,
        n,
        stream,
        include_usage,
        echo,
        sampling,
        add_special_tokens,
        request_id,
        continuous_usage,
        truncation,
        return_token_ids,
        tokens_as_ids,
        stop_regex,
        beam,
    )


def parse_generate(body: bytes) -> GenerateRequest:
    f = Fields(load_object(body))
    text, input_ids = f.raw("text"), f.raw("input_ids")
    if (text is None) == (input_ids is None):
        raise bad_request("Give exactly one of text or input_ids", "text")
    prompt_param = "text" if text is not None else "input_ids"
    prompts, batch = read_prompts(
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
    refuse_unserved(f, REFUSED_GENERATE)
    stream = f.get_bool("stream", False)
    return_text = f.get_bool("return_text_in_logprobs", False)
    check_ignored(f, GENERATE_IGNORED)
    lora_paths = _lora_paths(f.raw("lora_path"), len(prompts))
    f.ignore("sampling_params", "lora_path")  # read above
    f.warn_unknown("/generate")
    return GenerateRequest(prompts, rids, batch or n > 1, n, stream, return_logprob, return_text, samplings, lora_paths)


def _lora_paths(value: Any, n_prompts: int) -> tuple[str | None, ...]:
    """/generate's lora_path: one adapter's name for every prompt, or a list with one per prompt
    (null: the base model)."""
    if value is None:
        return ()
    if type(value) is str:
        return (value,) * n_prompts
    if type(value) is list and len(value) == n_prompts and all(v is None or type(v) is str for v in value):
        return tuple(value)
    raise bad_request("lora_path must be an adapter's name, or a list with one (or null) per prompt", "lora_path")


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
    n = read_n(sp, prompts=n_prompts)
    max_new_tokens = sp.get_int("max_new_tokens", GENERATE_MAX_NEW_TOKENS)
    names = {k: v.replace("sampling_params.", sp.prefix) for k, v in GENERATE_NAMES.items()}
    grammar = one_grammar(
        [
            (sp.param(key), kind, lambda key=key, read=read: read(sp.raw(key)))
            for key, kind, read in (
                *SGLANG_GRAMMARS,
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
    refuse_unserved(sp, REFUSED_SAMPLING_PARAMS)
    sp.warn_unknown("/generate")
    return n, SamplingSpec.build(values, max_new_tokens, names, prompt_param)


def parse_tokenize(body: bytes) -> TokenizeRequest:
    f = Fields(load_object(body))
    model = f.get_str("model")
    if (f.raw("prompt") is None) == (f.raw("messages") is None):
        raise bad_request("Give exactly one of prompt or messages", "prompt")
    prompts: tuple[str, ...]
    prompts, messages, template, batch = (), None, None, False
    if f.raw("messages") is not None:  # vLLM's chat fields of /tokenize: a chat completion's
        messages, rich = read_messages(f.raw("messages"))
        tools, _ = read_tools(f)
        template = template_for_messages(read_template_args(f, tools), messages, rich)
        add_special_tokens = template.add_special_tokens if template is not None else False
    else:
        prompts, batch = read_prompts(f.raw("prompt"), "prompt", token_ids_allowed=False, empty_allowed=True)
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
