"""Every request field of vLLM's ChatCompletionRequest, CompletionRequest and ResponsesRequest
(with OpenAI's own) and of SGLang's GenerateReqInput and SamplingParams, and what this server
does with it:

    served   it changes the request as documented in `how`; the walk asserts the effect on
             the parsed request (`check`) and, where the server's response shows it, on the
             response (`answer`)
    refused  a 400 whose `param` names the field (`how` says why): the server cannot honour it
    ignored  it changes no output in vLLM or SGLang either (`how` says why): type-checked, unused

The walk sends each field, alone, to a --null-model server and asserts its verdict; and every
field is known to the parsers (none falls to "ignoring unknown fields")."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from httpapi.chat_request import parse_chat_completion
from httpapi.errors import APIError
from httpapi.requests import parse_completion, parse_generate
from httpapi.responses_request import parse_responses_create
from protocol.sampling_params import GrammarKind

CHAT, COMPLETIONS, GENERATE, SAMPLING, RESPONSES = "chat", "completions", "generate", "sampling_params", "responses"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
STRUCTURAL_TAG = orjson.dumps(  # vLLM's legacy form (SGLang's too)
    {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
        "triggers": ["<f"],
    }
).decode()
BASES = {
    CHAT: {"messages": HI, "max_tokens": 4},
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 4},
    GENERATE: {"text": "Hi", "sampling_params": {"max_new_tokens": 4}},
    RESPONSES: {"input": "Hi", "max_output_tokens": 4},
}


@dataclass(frozen=True)
class F:
    where: str  # CHAT, COMPLETIONS, GENERATE, RESPONSES, or SAMPLING (/generate's sampling_params)
    name: str
    verdict: str  # served | refused | ignored
    value: Any  # what the walk sends
    how: str
    check: Callable[[Any], bool] | None = None  # served: on (request, its SamplingParams)
    extra: dict | None = None  # fields sent with it (a served field's companions)


def p(**want) -> Callable[[Any], bool]:
    """A check that the resolved SamplingParams has these values."""
    return lambda r: all(getattr(r[1], k) == v for k, v in want.items())


def grammar(kind: GrammarKind) -> Callable[[Any], bool]:
    return lambda r: r[1].grammar_kind == kind and bool(r[1].grammar)


def text_of(body: dict) -> str:
    choice = body["choices"][0] if "choices" in body else body
    return choice.get("text") if "text" in choice else choice["message"]["content"]


OPENAI_COMMON = [
    ("model", "served", "SmolLM2-135M-Instruct", "checked against the served name (404 otherwise)", None, None),
    ("frequency_penalty", "served", 0.5, "SamplingParams.frequency_penalty", p(frequency_penalty=0.5), None),
    ("presence_penalty", "served", 0.5, "SamplingParams.presence_penalty", p(presence_penalty=0.5), None),
    (
        "logit_bias",
        "served",
        {"42": 5},
        "SamplingParams.logit_bias: (id, bias) pairs",
        p(logit_bias=((42, 5.0),)),
        None,
    ),
    ("max_tokens", "served", 3, "SamplingParams.max_new_tokens", p(max_new_tokens=3), None),
    ("n", "served", 2, "that many choices", None, None),
    ("seed", "served", 7, "SamplingParams.seed", p(seed=7), None),
    ("stop", "served", ["zzz"], "SamplingParams.stop", p(stop=("zzz",)), None),
    ("stream", "served", False, "SSE events when true", None, None),
    ("stream_options", "served", {"include_usage": True}, "a usage event", None, {"stream": True}),
    ("temperature", "served", 0.0, "SamplingParams.temperature", p(temperature=0.0), None),
    ("top_p", "served", 0.5, "SamplingParams.top_p", p(top_p=0.5), None),
    ("user", "ignored", "u", "identifies the end user to OpenAI; no output changes", None, None),
    ("service_tier", "ignored", "auto", "OpenAI's billing tier", None, None),
    ("store", "ignored", True, "OpenAI stores the completion; nothing is stored here", None, None),
    ("metadata", "ignored", {"k": "v"}, "tags for OpenAI's stored completions", None, None),
    ("prompt_cache_key", "ignored", "k", "OpenAI's cache routing hint", None, None),
    ("safety_identifier", "ignored", "s", "OpenAI's abuse tracking", None, None),
    # vLLM's sampling extras
    ("top_k", "served", 5, "SamplingParams.top_k", p(top_k=5), None),
    ("min_p", "served", 0.1, "SamplingParams.min_p", p(min_p=0.1), None),
    ("repetition_penalty", "served", 1.1, "SamplingParams.repetition_penalty", p(repetition_penalty=1.1), None),
    ("stop_token_ids", "served", [42], "SamplingParams.stop_token_ids", p(stop_token_ids=(42,)), None),
    ("include_stop_str_in_output", "served", True, "SamplingParams.no_stop_trim", p(no_stop_trim=True), None),
    ("ignore_eos", "served", True, "SamplingParams.ignore_eos", p(ignore_eos=True), None),
    ("min_tokens", "served", 2, "SamplingParams.min_new_tokens", p(min_new_tokens=2), None),
    ("skip_special_tokens", "served", False, "SamplingParams.skip_special_tokens", p(skip_special_tokens=False), None),
    (
        "spaces_between_special_tokens",
        "served",
        False,
        "SamplingParams.spaces_between_special_tokens",
        p(spaces_between_special_tokens=False),
        None,
    ),
    ("prompt_logprobs", "served", 2, "SamplingParams.prompt_logprobs, from position 0", p(prompt_logprobs=2), None),
    (
        "use_beam_search",
        "served",
        True,
        "vLLM's beam search: n beams ranked by cumulative logprob, the best first (not streamed)",
        lambda r: r[0].beam is not None and r[0].beam.width == 2,
        {"n": 2},
    ),
    ("best_of", "refused", 3, "best_of > 1 is not supported (n is)", None, None),
    (
        "length_penalty",
        "ignored",
        0.5,
        "beam search's score exponent; alone (without use_beam_search) it changes nothing, as in vLLM",
        None,
        None,
    ),
    (
        "truncate_prompt_tokens",
        "served",
        1,
        "the prompt keeps its last k tokens (-1: the context's length)",
        lambda r: r[0].truncation.tokens == 1,
        None,
    ),
    ("truncation_side", "served", "right", "with truncate_prompt_tokens: keep the first k instead", None, None),
    (
        "allowed_token_ids",
        "served",
        [2, 1],
        "SamplingParams.allowed_token_ids: every other token's logit is -inf",
        p(allowed_token_ids=(1, 2)),
        None,
    ),
    ("bad_words", "refused", ["x"], "not supported", None, None),
    ("watermarking", "refused", True, "not supported", None, None),
    # vLLM's extra parameters
    (
        "response_format",
        "served",
        {"type": "json_object"},
        "JSON_SCHEMA grammar",
        grammar(GrammarKind.JSON_SCHEMA),
        None,
    ),
    ("structured_outputs", "served", {"regex": "[a-z]+"}, "its one grammar", grammar(GrammarKind.REGEX), None),
    ("guided_json", "served", {"type": "object"}, "JSON_SCHEMA grammar", grammar(GrammarKind.JSON_SCHEMA), None),
    ("guided_regex", "served", "[a-z]+", "REGEX grammar", grammar(GrammarKind.REGEX), None),
    ("guided_choice", "served", ["yes", "no"], "EBNF of the alternatives", grammar(GrammarKind.EBNF), None),
    ("guided_grammar", "served", 'root ::= "a"', "EBNF grammar", grammar(GrammarKind.EBNF), None),
    (
        "structural_tag",
        "served",
        STRUCTURAL_TAG,
        "STRUCTURAL_TAG grammar (vLLM's legacy form converted to xgrammar's)",
        grammar(GrammarKind.STRUCTURAL_TAG),
        None,
    ),
    ("guided_decoding_backend", "served", "xgrammar", "xgrammar or auto; others refused", None, None),
    ("guided_whitespace_pattern", "refused", r"\s*", "the server's whitespace setting applies", None, None),
    ("priority", "refused", 1, "priority scheduling is not supported", None, None),
    ("request_id", "served", "my-id", "the response's id is <prefix>-<request_id>", None, None),
    ("session_id", "ignored", "s", "a routing identity; no output changes", None, None),
    ("logits_processors", "refused", ["m.P"], "custom logits processors are not supported", None, None),
    (
        "return_tokens_as_token_ids",
        "served",
        True,
        'logprobs show tokens as "token_id:<id>"',
        lambda r: r[0].tokens_as_ids is True,
        None,
    ),
    (
        "return_token_ids",
        "served",
        True,
        "vLLM's: prompt_token_ids and each choice's token_ids in the answer",
        p(return_ids=True),
        None,
    ),
    ("return_token_offsets", "ignored", True, "vLLM ignores it outside its /render endpoints", None, None),
    ("routed_experts_prompt_start", "ignored", 0, "routed-expert data is never returned", None, None),
    ("cache_salt", "refused", "salt", "the prefix cache is shared: a salt would promise isolation", None, None),
    ("kv_transfer_params", "refused", {"a": 1}, "disaggregated serving is not supported", None, None),
    ("ec_transfer_params", "refused", {"a": 1}, "disaggregated serving is not supported", None, None),
    ("vllm_xargs", "refused", {"a": 1}, "custom extensions are not supported", None, None),
    ("repetition_detection", "refused", {"max_pattern_size": 4}, "not supported", None, None),
    ("stream_interval", "refused", 4, "the server's --stream-interval applies", None, None),
    ("mm_processor_kwargs", "refused", {"a": 1}, "a text-only model", None, None),
    # SGLang's extras of its OpenAI routes
    ("no_stop_trim", "served", True, "SamplingParams.no_stop_trim", p(no_stop_trim=True), None),
    ("regex", "served", "[a-z]+", "SGLang's: REGEX grammar", grammar(GrammarKind.REGEX), None),
    ("ebnf", "served", 'root ::= "a"', "SGLang's: EBNF grammar", grammar(GrammarKind.EBNF), None),
    (
        "json_schema",
        "served",
        '{"type": "object"}',
        "SGLang's: JSON_SCHEMA grammar",
        grammar(GrammarKind.JSON_SCHEMA),
        None,
    ),
    (
        "stop_regex",
        "served",
        "a+",
        "SGLang's: a choice stops where a pattern matches its text (the HTTP worker watches it)",
        lambda r: [p.pattern for p in r[0].stop_regex] == ["a+"],
        None,
    ),
    ("return_hidden_states", "refused", True, "not returned", None, None),
]
CHAT_ONLY = [
    (
        "thinking_token_budget",
        "served",
        4,
        "vLLM's: with a --reasoning-parser, the reasoning's end is forced after so many tokens (without one, "
        "as on the walk's server, a 400 naming it)",
        lambda r: r[0].thinking_budget == 4,
        None,
    ),
    ("messages", "served", HI, "rendered by the chat template", None, None),
    (
        "prompt_token_ids",
        "served",
        [1, 2, 3],
        "vLLM's pre-tokenized prompt: the ids, verbatim, in place of the rendered messages",
        lambda r: r[0].prompt_ids == (1, 2, 3),
        None,
    ),
    ("logprobs", "served", True, "SamplingParams.logprobs", p(logprobs=True), None),
    ("top_logprobs", "served", 2, "SamplingParams.top_logprobs", p(top_logprobs=2), {"logprobs": True}),
    (
        "logprob_token_ids",
        "served",
        [7, 1, 7],
        "vLLM's: these tokens' logprobs (and the sampled one's) instead of the top_logprobs likeliest",
        p(logprob_token_ids=(7, 1), top_logprobs=2),
        {"logprobs": True, "top_logprobs": 5},
    ),
    ("max_completion_tokens", "served", 3, "SamplingParams.max_new_tokens", p(max_new_tokens=3), None),
    ("tools", "served", [TOOL], "passed to the chat template; parsed for the response", None, None),
    ("tool_choice", "served", "required", "required / a function: a JSON_SCHEMA grammar of the call", None, None),
    ("parallel_tool_calls", "served", False, "carried for the response's tool calls", None, None),
    ("function_call", "refused", {"name": "f"}, "deprecated: use tool_choice (none/auto accepted)", None, None),
    ("functions", "refused", [{"name": "f"}], "deprecated: use tools", None, None),
    ("reasoning_effort", "served", "low", "passed to the chat template as reasoning_effort", None, None),
    (
        "include_reasoning",
        "served",
        False,
        "vLLM's: false drops the parsed reasoning",
        lambda r: not r[0].include_reasoning,
        None,
    ),
    (
        "separate_reasoning",
        "served",
        False,
        "SGLang's: false leaves the reasoning in the content",
        lambda r: not r[0].separate_reasoning,
        None,
    ),
    ("stream_reasoning", "refused", False, "SGLang's; false is not supported (true is)", None, None),
    ("verbosity", "ignored", "low", "vLLM and SGLang ignore it", None, None),
    ("prediction", "ignored", {"type": "content", "content": "x"}, "only a latency hint", None, None),
    ("modalities", "refused", ["text", "audio"], "text only (['text'] is accepted)", None, None),
    ("audio", "refused", {"voice": "x"}, "no audio output", None, None),
    ("web_search_options", "refused", {"search_context_size": "low"}, "web search is not supported", None, None),
    (
        "echo",
        "served",
        True,
        "vLLM's: the final message's content starts each choice's when its role is the answer's",
        lambda r: r[0].echo == "Hel",
        {"messages": [*HI, {"role": "assistant", "content": "Hel"}]},
    ),
    ("add_generation_prompt", "served", False, "the template's generation prompt is left out", None, None),
    ("continue_final_message", "served", True, "the final message is continued", None, None),
    ("add_special_tokens", "served", True, "the rendered text gets the tokenizer's special tokens", None, None),
    ("documents", "served", [{"title": "t", "text": "x"}], "passed to the chat template", None, None),
    ("chat_template", "refused", "{{ messages }}", "a client's Jinja would run in the server", None, None),
    ("chat_template_kwargs", "served", {"enable_thinking": False}, "extra variables of the template", None, None),
    ("media_io_kwargs", "refused", {"image": {}}, "a text-only model", None, None),
]
COMPLETIONS_ONLY = [
    ("thinking_token_budget", "refused", 100, "chat's only (-1, unlimited, is accepted)", None, None),
    ("prompt", "served", "Hi", "tokenized (or token ids as given)", None, None),
    ("logprobs", "served", 2, "SamplingParams.logprobs, top_logprobs", p(logprobs=True, top_logprobs=2), None),
    (
        "logprob_token_ids",
        "served",
        [7, 1, 7],
        "vLLM's: these tokens' logprobs (and the sampled one's) instead of the `logprobs` likeliest",
        p(logprob_token_ids=(7, 1), top_logprobs=2),
        {"logprobs": 0},
    ),
    ("echo", "served", True, "the prompt before the completion; with logprobs: prompt_logprobs", None, None),
    ("suffix", "refused", "x", "not supported (as in vLLM)", None, None),
    ("add_special_tokens", "served", False, "a text prompt without BOS and the like", None, None),
    ("prompt_embeds", "refused", "AAAA", "prompt embeddings are not supported", None, None),
]
GENERATE_TOP = [
    ("text", "served", "Hi", "tokenized", None, None),
    ("input_ids", "served", [1, 2], "the prompt as given", None, None),
    ("rid", "served", "my-rid", "the request's name (/abort_request, meta_info.id)", None, None),
    ("stream", "served", False, "SSE events when true", None, None),
    ("return_logprob", "served", True, "SamplingParams.logprobs", p(logprobs=True), None),
    ("top_logprobs_num", "served", 2, "SamplingParams.top_logprobs", p(top_logprobs=2), {"return_logprob": True}),
    (
        "logprob_start_len",
        "served",
        0,
        "prompt logprobs from there (-1: none)",
        p(prompt_logprobs=0, prompt_logprobs_start=0),
        {"return_logprob": True},
    ),
    ("return_text_in_logprobs", "served", True, "logprobs carry the token's text", None, None),
    ("sampling_params", "served", {"max_new_tokens": 2}, "the sampling", p(max_new_tokens=2), None),
    ("input_embeds", "refused", [[0.1]], "input embeddings are not supported", None, None),
    ("image_data", "refused", "data:image/png;base64,AAAA", "a text-only model", None, None),
    ("video_data", "refused", "v.mp4", "a text-only model", None, None),
    ("audio_data", "refused", "a.wav", "a text-only model", None, None),
    ("use_audio_in_video", "refused", True, "a text-only model", None, None),
    ("modalities", "refused", ["image"], "a text-only model", None, None),
    ("token_ids_logprob", "refused", [1], "not supported (top logprobs are)", None, None),
    ("return_hidden_states", "refused", True, "not returned", None, None),
    ("return_routed_experts", "refused", True, "not returned", None, None),
    ("return_indexer_topk", "refused", True, "not returned", None, None),
    ("return_entropy", "refused", True, "not returned", None, None),
    ("return_bytes", "refused", True, "not supported", None, None),
    ("routed_experts_start_len", "ignored", 0, "routed experts are never returned", None, None),
    ("session_params", "refused", {"id": "s"}, "sessions are not supported", None, None),
    ("lora_path", "served", "ad", "the adapter's name", lambda r: r[0].lora_paths == ("ad",), None),
    ("lora_id", "refused", "l", "adapters are named by lora_path", None, None),
    ("custom_logit_processor", "refused", "p", "not supported", None, None),
    ("positional_embed_overrides", "refused", [1], "not supported", None, None),
    ("bootstrap_host", "refused", "h", "disaggregated serving is not supported", None, None),
    ("bootstrap_port", "refused", 1, "disaggregated serving is not supported", None, None),
    ("bootstrap_room", "refused", 1, "disaggregated serving is not supported", None, None),
    ("bootstrap_pair_key", "refused", "k", "disaggregated serving is not supported", None, None),
    ("decode_tp_size", "refused", 2, "disaggregated serving is not supported", None, None),
    ("require_reasoning", "refused", True, "not supported", None, None),
    ("routed_dp_rank", "ignored", 0, "one engine: nothing to route", None, None),
    ("disagg_prefill_dp_rank", "ignored", 0, "no disaggregation: nothing to route", None, None),
    ("data_parallel_rank", "ignored", 0, "one engine: nothing to route", None, None),
    ("background", "refused", True, "background requests are not supported", None, None),
    ("conversation_id", "ignored", "c", "tracking only", None, None),
    ("priority", "refused", 1, "priority scheduling is not supported", None, None),
    ("extra_key", "refused", "k", "a cache salt: the prefix cache is shared", None, None),
    ("routing_key", "ignored", "k", "routing only", None, None),
    ("no_logs", "ignored", True, "prompts are not logged here anyway", None, None),
    ("log_metrics", "ignored", False, "metrics only", None, None),
    ("custom_labels", "ignored", {"a": "b"}, "metrics labels only", None, None),
    ("external_trace_header", "ignored", {"traceparent": "x"}, "tracing only", None, None),
    ("received_time", "ignored", 1.5, "timing only", None, None),
    ("need_wait_for_mm_inputs", "refused", True, "a text-only model", None, None),
    ("num_items_assigned", "refused", {"image": [1]}, "a text-only model", None, None),
    ("max_dynamic_patch", "refused", 4, "a text-only model", None, None),
    ("min_dynamic_patch", "refused", 1, "a text-only model", None, None),
    ("image_max_dynamic_patch", "refused", 4, "a text-only model", None, None),
    ("video_max_dynamic_patch", "refused", 4, "a text-only model", None, None),
    ("multi_item_delimiter_indices", "refused", [1], "multi-item scoring is not supported", None, None),
]
SAMPLING_PARAMS = [
    ("max_new_tokens", "served", 3, "SamplingParams.max_new_tokens", p(max_new_tokens=3), None),
    ("stop", "served", ["zzz"], "SamplingParams.stop", p(stop=("zzz",)), None),
    ("stop_token_ids", "served", [42], "SamplingParams.stop_token_ids", p(stop_token_ids=(42,)), None),
    ("stop_regex", "refused", "a+", "served on the OpenAI routes, not on /generate", None, None),
    ("temperature", "served", 0.0, "SamplingParams.temperature", p(temperature=0.0), None),
    ("top_p", "served", 0.5, "SamplingParams.top_p", p(top_p=0.5), None),
    ("top_k", "served", 5, "SamplingParams.top_k", p(top_k=5), None),
    ("min_p", "served", 0.1, "SamplingParams.min_p", p(min_p=0.1), None),
    ("frequency_penalty", "served", 0.5, "SamplingParams.frequency_penalty", p(frequency_penalty=0.5), None),
    ("presence_penalty", "served", 0.5, "SamplingParams.presence_penalty", p(presence_penalty=0.5), None),
    ("repetition_penalty", "served", 1.1, "SamplingParams.repetition_penalty", p(repetition_penalty=1.1), None),
    ("min_new_tokens", "served", 2, "SamplingParams.min_new_tokens", p(min_new_tokens=2), None),
    ("n", "served", 2, "that many choices", None, None),
    ("json_schema", "served", '{"type": "object"}', "JSON_SCHEMA grammar", grammar(GrammarKind.JSON_SCHEMA), None),
    ("regex", "served", "[a-z]+", "REGEX grammar", grammar(GrammarKind.REGEX), None),
    ("ebnf", "served", 'root ::= "a"', "EBNF grammar", grammar(GrammarKind.EBNF), None),
    (
        "structural_tag",
        "served",
        STRUCTURAL_TAG,
        "STRUCTURAL_TAG grammar",
        grammar(GrammarKind.STRUCTURAL_TAG),
        None,
    ),
    ("ignore_eos", "served", True, "SamplingParams.ignore_eos", p(ignore_eos=True), None),
    ("skip_special_tokens", "served", False, "SamplingParams.skip_special_tokens", p(skip_special_tokens=False), None),
    (
        "spaces_between_special_tokens",
        "served",
        False,
        "SamplingParams.spaces_between_special_tokens",
        p(spaces_between_special_tokens=False),
        None,
    ),
    ("no_stop_trim", "served", True, "SamplingParams.no_stop_trim", p(no_stop_trim=True), None),
    ("custom_params", "refused", {"a": 1}, "custom logit processors are not supported", None, None),
    ("stream_interval", "refused", 4, "the server's --stream-interval applies", None, None),
    ("logit_bias", "served", {"42": 5}, "SamplingParams.logit_bias", p(logit_bias=((42, 5.0),)), None),
    ("sampling_seed", "served", 7, "SamplingParams.seed", p(seed=7), None),
]

FLAT_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
WALKED_RESPONSE = "resp_walk"  # the walk stores it first: previous_response_id continues it
RESPONSES_FIELDS = [  # OpenAI's ResponseCreateParams and vLLM's ResponsesRequest
    ("model", "served", "SmolLM2-135M-Instruct", "checked against the served name (404 otherwise)", None, None),
    ("input", "served", "Hi", "a user message, or items: messages, function calls and outputs, reasoning", None, None),
    ("instructions", "served", "Be brief.", "a system message first", lambda r: r[0].instructions == "Be brief.", None),
    ("max_output_tokens", "served", 3, "SamplingParams.max_new_tokens", p(max_new_tokens=3), None),
    ("use_beam_search", "refused", True, "beam search is served on completions and chat", None, None),
    ("temperature", "served", 0.5, "SamplingParams.temperature", p(temperature=0.5), None),
    ("top_p", "served", 0.5, "SamplingParams.top_p", p(top_p=0.5), None),
    ("top_k", "served", 5, "vLLM's: SamplingParams.top_k", p(top_k=5), None),
    ("repetition_penalty", "served", 1.1, "vLLM's", p(repetition_penalty=1.1), None),
    ("seed", "served", 7, "vLLM's", p(seed=7), None),
    ("stop", "served", ["zz"], "vLLM's", p(stop=("zz",)), None),
    ("ignore_eos", "served", True, "vLLM's", p(ignore_eos=True), None),
    ("logit_bias", "served", {"42": 5}, "vLLM's", p(logit_bias=((42, 5.0),)), None),
    ("skip_special_tokens", "served", False, "vLLM's", p(skip_special_tokens=False), None),
    ("include_stop_str_in_output", "served", True, "vLLM's", p(no_stop_trim=True), None),
    ("tools", "served", [FLAT_TOOL], "flat function tools, as chat's", lambda r: len(r[0].tools) == 1, None),
    (
        "tool_choice",
        "served",
        "required",
        "as chat's: a JSON_SCHEMA grammar of the calls",
        grammar(GrammarKind.JSON_SCHEMA),
        {"tools": [FLAT_TOOL]},
    ),
    ("parallel_tool_calls", "served", False, "one call at most", lambda r: not r[0].parallel_tool_calls, None),
    ("max_tool_calls", "served", 2, "calls kept at most", lambda r: r[0].max_tool_calls == 2, None),
    (
        "text",
        "served",
        {"format": {"type": "json_object"}},
        "text.format: a JSON_SCHEMA grammar",
        grammar(GrammarKind.JSON_SCHEMA),
        None,
    ),
    ("structured_outputs", "served", {"regex": "[a-z]+"}, "vLLM's: a grammar", grammar(GrammarKind.REGEX), None),
    ("include", "served", ["message.output_text.logprobs"], "the output text's logprobs", p(logprobs=True), None),
    ("stop_regex", "refused", "a+", "SGLang's: served on chat and completions, not here", None, None),
    (
        "top_logprobs",
        "served",
        2,
        "SamplingParams.top_logprobs",
        p(top_logprobs=2),
        {"include": ["message.output_text.logprobs"]},
    ),
    (
        "reasoning",
        "served",
        {"effort": "low"},
        "effort: the chat template's reasoning_effort",
        lambda r: r[0].chat_template_kwargs == {"reasoning_effort": "low"},
        None,
    ),
    (
        "chat_template_kwargs",
        "served",
        {"enable_thinking": False},
        "passed to the chat template",
        lambda r: r[0].chat_template_kwargs == {"enable_thinking": False},
        None,
    ),
    ("stream", "served", True, "OpenAI's typed SSE events", lambda r: r[0].stream, None),
    (
        "stream_options",
        "served",
        {"include_obfuscation": False},
        "no obfuscation padding is ever sent",
        None,
        {"stream": True},
    ),
    (
        "store",
        "served",
        False,
        "kept for retrieval and previous_response_id (default true)",
        lambda r: not r[0].store,
        None,
    ),
    (
        "previous_response_id",
        "served",
        WALKED_RESPONSE,
        "continues a stored response",
        lambda r: r[0].previous_response_id == WALKED_RESPONSE,
        None,
    ),
    ("background", "served", True, "answered queued at once; runs and is stored", lambda r: r[0].background, None),
    (
        "metadata",
        "served",
        {"k": "v"},
        "echoed (16 pairs at most)",
        lambda r: r[0].echo["metadata"] == {"k": "v"},
        None,
    ),
    (
        "truncation",
        "served",
        "auto",
        '"auto": the oldest turns are dropped until the input fits ("disabled": an input over the context is a 400)',
        lambda r: r[0].truncation == "auto",
        None,
    ),
    (
        "request_id",
        "served",
        "my-id",
        "vLLM's: the response's id is resp_<request_id>",
        lambda r: r[0].request_id == "my-id",
        None,
    ),
    ("user", "ignored", "u", "an end user's id for OpenAI's abuse checks", None, None),
    ("safety_identifier", "ignored", "s", "an end user's id for OpenAI's abuse checks", None, None),
    ("service_tier", "ignored", "auto", "one tier; vLLM ignores it too", None, None),
    ("prompt_cache_key", "ignored", "k", "the prefix cache is automatic; vLLM ignores it too", None, None),
    ("conversation", "refused", "conv_1", "no conversations API: previous_response_id continues one", None, None),
    ("prompt", "refused", {"id": "pmpt_1"}, "no stored prompt templates", None, None),
    ("context_management", "refused", [{"type": "compaction"}], "no compaction", None, None),
    ("background_options", "refused", {"a": 1}, "not served", None, None),
    ("moderation", "refused", {"a": 1}, "no moderation", None, None),
    ("image", "refused", {"a": 1}, "text only", None, None),
    ("access_programs", "refused", ["p"], "not served", None, None),
    ("prompt_cache_options", "refused", {"a": 1}, "the prefix cache is automatic", None, None),
    ("prompt_cache_retention", "refused", "24h", "the prefix cache is automatic", None, None),
    (
        "enable_response_messages",
        "served",
        True,
        "vLLM's: input_messages and output_messages, the raw prompt and output with their token ids",
        lambda r: r[0].raw_messages and r[1].return_ids,
        None,
    ),
    ("previous_input_messages", "refused", [HI[0]], "vLLM's Harmony messages: not served", None, None),
    ("media_io_kwargs", "refused", {"image": {}}, "text only", None, None),
    ("mm_processor_kwargs", "refused", {"a": 1}, "text only", None, None),
    ("priority", "refused", 1, "no priority scheduling", None, None),
    ("cache_salt", "refused", "salt", "one prefix cache for all requests", None, None),
    ("kv_transfer_params", "refused", {"a": 1}, "no disaggregated serving", None, None),
    ("vllm_xargs", "refused", {"a": 1}, "no custom extensions", None, None),
    (
        "thinking_token_budget",
        "served",
        4,
        "as chat's (needs a --reasoning-parser: the walk's server has none, a 400 naming it)",
        lambda r: r[0].thinking_budget == 4,
        None,
    ),
]


def _fields(where: str, rows: list[tuple]) -> list[F]:
    return [F(where, name, verdict, value, how, check, extra) for name, verdict, value, how, check, extra in rows]


FIELDS: list[F] = (
    _fields(CHAT, OPENAI_COMMON + CHAT_ONLY)
    + _fields(COMPLETIONS, OPENAI_COMMON + COMPLETIONS_ONLY)
    + _fields(GENERATE, GENERATE_TOP)
    + _fields(SAMPLING, SAMPLING_PARAMS)
    + _fields(RESPONSES, RESPONSES_FIELDS)
)
# Responses the server's output shows (beyond a 200): field -> check of the JSON body
ANSWERS: dict[tuple[str, str], Callable[[dict], bool]] = {
    (CHAT, "n"): lambda b: len(b["choices"]) == 2,
    (COMPLETIONS, "n"): lambda b: len(b["choices"]) == 2,
    (CHAT, "use_beam_search"): lambda b: len(b["choices"]) == 2,
    (COMPLETIONS, "use_beam_search"): lambda b: len(b["choices"]) == 2,
    (CHAT, "max_tokens"): lambda b: b["usage"]["completion_tokens"] == 3,
    (CHAT, "max_completion_tokens"): lambda b: b["usage"]["completion_tokens"] == 3,
    (COMPLETIONS, "max_tokens"): lambda b: b["usage"]["completion_tokens"] == 3,
    (CHAT, "request_id"): lambda b: b["id"] == "chatcmpl-my-id",
    (COMPLETIONS, "request_id"): lambda b: b["id"] == "cmpl-my-id",
    (COMPLETIONS, "echo"): lambda b: b["choices"][0]["text"].startswith("Hi"),
    (CHAT, "echo"): lambda b: b["choices"][0]["message"]["content"].startswith("Hel"),
    (CHAT, "truncate_prompt_tokens"): lambda b: b["usage"]["prompt_tokens"] == 1,
    (CHAT, "return_token_ids"): lambda b: len(b["choices"][0]["token_ids"]) == b["usage"]["completion_tokens"],
    (COMPLETIONS, "return_token_ids"): lambda b: (
        len(b["choices"][0]["prompt_token_ids"]) == b["usage"]["prompt_tokens"]
    ),
    (COMPLETIONS, "truncate_prompt_tokens"): lambda b: b["usage"]["prompt_tokens"] == 1,
    (CHAT, "logprobs"): lambda b: b["choices"][0]["logprobs"] is not None,
    (COMPLETIONS, "logprobs"): lambda b: len(b["choices"][0]["logprobs"]["top_logprobs"][0]) == 2,
    (GENERATE, "rid"): lambda b: b["meta_info"]["id"] == "my-rid",
    (GENERATE, "return_logprob"): lambda b: "output_token_logprobs" in b["meta_info"],
    (SAMPLING, "max_new_tokens"): lambda b: b["meta_info"]["completion_tokens"] == 3,
    (SAMPLING, "n"): lambda b: isinstance(b, list) and len(b) == 2,
    (CHAT, "guided_choice"): lambda b: text_of(b) in ("yes", "no"),
    (COMPLETIONS, "guided_regex"): lambda b: text_of(b).isalpha() and text_of(b).islower(),
    (COMPLETIONS, "regex"): lambda b: text_of(b).isalpha() and text_of(b).islower(),
    (CHAT, "ebnf"): lambda b: text_of(b) == "a",
    (SAMPLING, "regex"): lambda b: text_of(b).isalpha() and text_of(b).islower(),
    (RESPONSES, "max_output_tokens"): lambda b: b["usage"]["output_tokens"] == 3,
    (RESPONSES, "request_id"): lambda b: b["id"] == "resp_my-id",
    (RESPONSES, "background"): lambda b: b["status"] in ("queued", "in_progress"),
    (RESPONSES, "previous_response_id"): lambda b: b["previous_response_id"] == WALKED_RESPONSE,
    (RESPONSES, "metadata"): lambda b: b["metadata"] == {"k": "v"},
    (RESPONSES, "enable_response_messages"): lambda b: (
        len(b["input_messages"][0]["tokens"]) == b["usage"]["input_tokens"]
        and len(b["output_messages"][0]["tokens"]) == b["usage"]["output_tokens"]
    ),
}
# served fields the walk's server answers with a 400 naming them: it runs without what they need
NEEDS_MORE = {
    (GENERATE, "lora_path"): "--enable-lora",
    (CHAT, "thinking_token_budget"): "--reasoning-parser",
    (RESPONSES, "thinking_token_budget"): "--reasoning-parser",
}
PATHS = {
    CHAT: "/v1/chat/completions",
    COMPLETIONS: "/v1/completions",
    GENERATE: "/generate",
    SAMPLING: "/generate",
    RESPONSES: "/v1/responses",
}
# tool_choice needs tools; continue_final_message needs an assistant's message and no generation prompt
COMPANIONS = {
    "tool_choice": {"tools": [TOOL]},
    "parallel_tool_calls": {"tools": [TOOL]},
    "continue_final_message": {
        "add_generation_prompt": False,
        "messages": [*HI, {"role": "assistant", "content": "Hel"}],
    },
}


def body_of(field: F) -> dict:
    if field.where == SAMPLING:
        body = dict(BASES[GENERATE])
        body["sampling_params"] = {**body["sampling_params"], field.name: field.value}
    else:
        companions = COMPANIONS.get(field.name, {}) if field.where != RESPONSES else {}  # theirs: in `extra`
        body = {**BASES[field.where], **companions, **(field.extra or {}), field.name: field.value}
    if field.where == GENERATE and field.name == "input_ids":
        del body["text"]
    return body


def param_of(field: F) -> str:
    return f"sampling_params.{field.name}" if field.where == SAMPLING else field.name


def parse(field: F) -> tuple[Any, Any]:
    """(the parsed request, its first prompt's SamplingParams) as the route makes them."""
    body = orjson.dumps(body_of(field))
    if field.where == CHAT:
        req = parse_chat_completion(body)
        sampling = req.sampling
    elif field.where == COMPLETIONS:
        req = parse_completion(body)
        sampling = req.sampling
    elif field.where == RESPONSES:
        req = parse_responses_create(body)
        sampling = req.sampling
    else:
        req = parse_generate(body)
        sampling = req.samplings[0]
    sampling.check_grammar("xgrammar", False)
    return req, sampling.resolve([1, 2, 3], 8192, 49152)


def test_the_table_names_every_field_once():
    keys = [(f.where, f.name) for f in FIELDS]
    assert len(keys) == len(set(keys))
    assert {f.verdict for f in FIELDS} == {"served", "refused", "ignored"}
    assert all(f.how for f in FIELDS)
    assert set(ANSWERS) <= set(keys)


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f"{f.where}.{f.name}")
def test_parsers_know_the_field(field: F, caplog):
    """No field falls through to "ignoring unknown fields"; a refusal names the field; a served
    field reaches the request as documented."""
    with caplog.at_level(logging.WARNING, logger="ringserve.httpapi"):
        if field.verdict == "refused":
            with pytest.raises(APIError) as caught:
                parse(field)
            assert (caught.value.status, caught.value.param) == (400, param_of(field)), caught.value.message
        else:
            req, params = parse(field)
            if field.check is not None:
                assert field.check((req, params)), params
    assert "ignoring unknown fields" not in caplog.text


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        null_model=True,
        log_level="warning",
        max_total_tokens=16384,
        max_running_requests=32,
    )


def test_the_walk(server):
    """Every field against the server: refused ones a 400 naming them, the others a 200 (and
    the response's documented effect, where it shows one); the server stays healthy."""
    failures = []
    with httpx.Client(base_url=server.base, timeout=60) as client:
        stored = client.post(PATHS[RESPONSES], json={**BASES[RESPONSES], "request_id": WALKED_RESPONSE[5:]})
        assert stored.json()["id"] == WALKED_RESPONSE, stored.text
        for field in FIELDS:
            r = client.post(PATHS[field.where], json=body_of(field))
            label = f"{field.where}.{field.name} ({field.verdict})"
            if field.verdict == "refused" or (field.where, field.name) in NEEDS_MORE:
                param = r.json()["error"]["param"] if r.status_code == 400 else None
                if (r.status_code, param) != (400, param_of(field)):
                    failures.append(f"{label}: {r.status_code} {r.text[:200]}")
            elif r.status_code != 200:
                failures.append(f"{label}: {r.status_code} {r.text[:200]}")
            elif (field.where, field.name) in ANSWERS and not ANSWERS[field.where, field.name](r.json()):
                failures.append(f"{label}: the response does not show it: {r.text[:300]}")
        assert client.get("/health").status_code == 200
    assert not failures, "\n".join(failures)
