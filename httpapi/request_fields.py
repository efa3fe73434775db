"""The field checks every endpoint's parser shares: prompts, n, stream, the fields this
server refuses or ignores, and the client's name for its request."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, overload

import regex

from httpapi.errors import bad_request
from httpapi.fields import Fields, is_token_ids, shown
from protocol.sampling_params import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, WHOLE_VOCABULARY, SamplingParams

MAX_STOP_REGEX_CHARS = 1024  # SGLang's stop_regex: each pattern's length
MAX_CHOICES = 128  # n times the number of prompts in one request
# Fields that change no output, in vLLM and SGLang either (tests/server/test_request_fields.py says why
# for each): type-checked, then unused.
IGNORED_STRS = ("user", "service_tier", "session_id", "prompt_cache_key", "safety_identifier", "verbosity")
IGNORED_BOOLS = ("store", "return_token_offsets")
IGNORED_OBJECTS = ("metadata", "prediction")
IGNORED_NUMBERS = ("routed_experts_prompt_start",)  # MoE routing data's
# vLLM's and OpenAI's fields this server does not serve: field -> why. A value is refused unless
# it asks for nothing (null, false, 0, an empty list or object, or the value in NOTHING_ASKED).
REFUSED_OPENAI = {
    "bad_words": "bad_words is not supported",
    "logits_processors": "custom logits processors are not supported",
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
    "best_of": "best_of is not supported; use n",
    "stream_reasoning": "stream_reasoning false is not supported: reasoning is streamed as it comes",
    "return_hidden_states": "hidden states are not returned by this server",
    "modalities": "this server runs a text-only model: only the text modality",
}
ASK_NOTHING: tuple = (False, 0, "", [], {})  # a refused field's values that ask for nothing, but for:
NOTHING_ASKED: dict[str, tuple] = {
    "best_of": (1,),
    "thinking_token_budget": (-1,),
    "stream_reasoning": (True,),  # SGLang's default, which sglang-router sends with every chat
    "modalities": (["text"],),
}


# vLLM's beam search ranks 2 * n candidates a beam each step, from a token's top logprobs
MAX_BEAM_WIDTH = MAX_TOP_LOGPROBS // 2
# what a beam search's answer is decided by besides its beams (runtime/http_worker/beam_search.py):
# every other sampling parameter must keep its default
BEAM_SEARCH_PARAMS = frozenset(
    {
        "max_new_tokens",
        "temperature",  # vLLM's beams rank raw logprobs, which no temperature changes
        "seed",
        "ignore_eos",
        "no_stop_trim",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "return_ids",
        "lora_id",
        "extra",
    }
)


@dataclass(frozen=True)
class BeamSearch:
    """vLLM's use_beam_search: `width` (the request's n) beams, the best returned first."""

    width: int
    length_penalty: float = 1.0  # a beam's score: its cumulative logprob / its length ** length_penalty


def read_beam_search(f: Fields, n: int, stream: bool) -> BeamSearch | None:
    """vLLM's use_beam_search and its length_penalty (type-checked, and unused, without it).
    Its beams are ranked at the end, so it does not stream."""
    length_penalty = f.get_float("length_penalty")
    if not f.get_bool("use_beam_search", False):
        return None
    if n > MAX_BEAM_WIDTH:
        raise bad_request(
            f"n is at most {MAX_BEAM_WIDTH} with use_beam_search: each step ranks 2n candidates a beam, from a "
            f"token's top logprobs, of which this server returns at most {MAX_TOP_LOGPROBS}",
            "n",
        )
    if stream:
        raise bad_request("stream is not served with use_beam_search: its beams are ranked only at the end", "stream")
    return BeamSearch(n, 1.0 if length_penalty is None else length_penalty)


def check_beam_search(params: SamplingParams, names: Mapping[str, str], *, echo: bool, stop_regex: bool) -> None:
    """A beam search's other sampling parameters must keep their defaults, and echo and
    stop_regex be unasked: a 400 naming the first that is not (vLLM's beam search ignores them;
    this server refuses what it would ignore)."""
    for asked, param in ((echo, "echo"), (stop_regex, "stop_regex")):
        if asked:
            raise bad_request(f"{param} is not served with use_beam_search", param)
    default = SamplingParams()
    for field in dataclasses.fields(SamplingParams):
        if field.name not in BEAM_SEARCH_PARAMS and getattr(params, field.name) != getattr(default, field.name):
            param = names.get(field.name, field.name)
            raise bad_request(f"{param} is not served with use_beam_search", param)


def ignored_fields(table: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """A table of fields that change no output, {kind: names} -> {name: kind} for check_ignored.
    Kinds: str, bool, int, number, object."""
    return {key: kind for kind, keys in table.items() for key in keys}


OPENAI_IGNORED = ignored_fields(
    {"str": IGNORED_STRS, "bool": IGNORED_BOOLS, "number": IGNORED_NUMBERS, "object": IGNORED_OBJECTS}
)
MAX_REQUEST_ID_CHARS = 256
# a client's name for its request: visible ASCII only (it is echoed in a header, and logged)
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")
Prompt = str | list  # text, or a list of token ids


@overload
def read_prompts(
    value: Any, param: str, *, token_ids_allowed: Literal[False], empty_allowed: bool = False
) -> tuple[tuple[str, ...], bool]: ...
@overload
def read_prompts(
    value: Any, param: str, *, token_ids_allowed: bool, text_allowed: bool = True, empty_allowed: bool = False
) -> tuple[tuple[Prompt, ...], bool]: ...
def read_prompts(
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


def read_stop_regex(f: Fields) -> tuple[regex.Pattern, ...]:
    """SGLang's stop_regex: a pattern or a list of them; a choice stops where one matches its
    text (runtime/http_worker/stop_regex.py). Each compiled here: a 400 naming the field for a
    bad one, too many, or one too long."""
    patterns = f.get_strs("stop_regex")
    param = f.param("stop_regex")
    if len(patterns) > MAX_STOP_STRINGS or not all(0 < len(p) <= MAX_STOP_REGEX_CHARS for p in patterns):
        raise bad_request(
            f"{param} must be at most {MAX_STOP_STRINGS} non-empty patterns of at most {MAX_STOP_REGEX_CHARS} "
            f"characters each",
            param,
        )
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(regex.compile(pattern))
        except (regex.error, OverflowError, RecursionError) as e:
            raise bad_request(f"{param} {shown(pattern)} is not a valid regular expression: {e}", param) from None
    return tuple(compiled)


def read_stream(f: Fields) -> tuple[bool, bool, bool]:
    """(stream, include_usage: a usage chunk before DONE, continuous: usage on every chunk too,
    vLLM's continuous_usage_stats, which asks for it only with include_usage, as vLLM reads it)."""
    stream = f.get_bool("stream", False)
    options = f.get_object("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    include_usage = options.get_bool("include_usage", False)
    continuous = options.get_bool("continuous_usage_stats", False)
    options.warn_unknown("stream_options")
    return stream, include_usage, include_usage and continuous


def read_n(f: Fields, prompts: int) -> int:
    n = f.get_int("n", 1, minimum=1, maximum=MAX_CHOICES)
    if n * prompts > MAX_CHOICES:
        raise bad_request(
            f"{f.param('n')} times the number of prompts ({n} x {prompts}) must be at most {MAX_CHOICES}", f.param("n")
        )
    return n


def read_logprobs_count(f: Fields, key: str) -> int | None:
    """A count of logprobs per position (top_logprobs, completions' logprobs, prompt_logprobs):
    vLLM's -1, every token of the vocabulary, is WHOLE_VOCABULARY until the vocabulary is known
    (--max-logprobs decides whether it is served; the ranges are validate()'s)."""
    k = f.get_int(key)
    return WHOLE_VOCABULARY if k == -1 else k


def read_prompt_logprobs(f: Fields) -> int:
    """vLLM's prompt_logprobs: each prompt token's logprob and this many alternatives; -1: none."""
    k = read_logprobs_count(f, "prompt_logprobs")
    if k is None:
        return -1
    if k < 0:
        raise bad_request(
            "prompt_logprobs must be at least 0, or -1 for every token of the vocabulary", "prompt_logprobs"
        )
    return k


def refuse_unserved(f: Fields, refused: dict[str, str]) -> None:
    """A field this server does not serve is a 400 naming it, unless its value asks for nothing
    (null, or its NOTHING_ASKED values, else false, 0, "", [] or {}): then it changes nothing."""
    for key in f.present(refused):
        value = f.obj.get(key)
        if value is None:
            continue
        f.read.add(key)
        if not any(type(value) is type(v) and value == v for v in NOTHING_ASKED.get(key, ASK_NOTHING)):
            raise bad_request(f"{f.param(key)}: {refused[key]}", f.param(key))


def check_ignored(f: Fields, kinds: dict[str, str] | None = None) -> None:
    """Fields that change no output get their types checked, as vLLM and SGLang check them.
    kinds: ignored_fields()' table (default: OpenAI's)."""
    kinds = OPENAI_IGNORED if kinds is None else kinds
    for key in f.present(kinds):
        kind = kinds[key]
        if kind == "bool":
            f.get_bool(key, False)
        else:
            getattr(f, _GETTERS[kind])(key)


_GETTERS = {"str": "get_str", "int": "get_int", "number": "get_float", "object": "get_object"}


def sglang_no_stop_trim(f: Fields, values: dict[str, Any]) -> None:
    """SGLang's name on its OpenAI routes for vLLM's include_stop_str_in_output: either keeps the stop."""
    values["no_stop_trim"] = f.get_bool("no_stop_trim", False) or values["no_stop_trim"]


@dataclass(frozen=True)
class PromptTruncation:
    """vLLM's truncate_prompt_tokens: a prompt keeps its last `tokens` tokens (its first, with
    truncation_side "right"); -1: as many as the context holds."""

    tokens: int
    side: str = "left"

    def apply(self, ids: list[int], context_len: int) -> list[int]:
        keep = context_len if self.tokens == -1 else self.tokens
        if len(ids) <= keep:
            return ids
        return ids[len(ids) - keep :] if self.side == "left" else ids[:keep]


def read_truncation(f: Fields) -> PromptTruncation | None:
    """vLLM's truncate_prompt_tokens (-1, or at least 1) and truncation_side (left or right)."""
    tokens = f.get_int("truncate_prompt_tokens")
    side = f.get_str("truncation_side", "left", choices=("left", "right"))
    if tokens is None:
        return None
    if tokens < 1 and tokens != -1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the context's length) or at least 1, not {tokens}",
            "truncate_prompt_tokens",
        )
    return PromptTruncation(tokens, side)


def read_request_id(f: Fields) -> str | None:
    request_id = f.get_str("request_id")
    return None if request_id is None else check_request_id(request_id, "request_id")


def check_request_id(value: str, param: str) -> str:
    """A client's name for its request, as the body's request_id or the x-request-id header
    (`param`): 1 to MAX_REQUEST_ID_CHARS visible ASCII characters, else a 400 naming `param`."""
    if _REQUEST_ID.fullmatch(value) is None:
        raise bad_request(
            f"{param} must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters (no spaces), not {shown(value)}",
            param,
        )
    return value
