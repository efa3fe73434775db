"""Request fields -> SamplingParams, the check of a grammar (before any engine work), and the
checks that need the prompt: it must be non-empty, in the vocabulary, and leave room in the
context for max_tokens.

Ranges live in SamplingParams.validate() (one place); this module only renames its
parameter names to the fields of each endpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from httpapi.errors import bad_request, from_invalid_param
from httpapi.fields import Fields
from protocol.memo import ByteLRU, string_bytes
from protocol.records import MAX_OPEN_PAYLOAD_BYTES, MAX_REQUEST_PAYLOAD_BYTES
from protocol.request_records import MEMO_BYTES, sampling_payload_bytes, stop_payload_bytes
from protocol.sampling_params import (
    FLOAT_RANGES,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_GRAMMAR_BYTES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_ENTRIES,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    WHOLE_VOCABULARY,
    InvalidParam,
    SamplingParams,
)
from structured.grammars import InvalidGrammar, check_grammar, is_checked

# SamplingParams fields that every generation endpoint names the same way.
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")
_DEFAULTS = SamplingParams()


def read_sampling(fields: Fields, *, seed: str, min_tokens: str, no_stop_trim: str, **given) -> dict[str, Any]:
    """The sampling fields of `fields` (`seed`, `min_tokens` and `no_stop_trim` named as given,
    the rest as SamplingParams names them), plus `given` fields the caller read itself:
    SamplingParams' arguments but max_new_tokens (SamplingSpec.build's), not validated."""
    values = dict(given)
    for name in _FLOATS:
        values[name] = fields.get_float(name, getattr(_DEFAULTS, name), within=FLOAT_RANGES.get(name))
    for name in _BOOLS:
        values[name] = fields.get_bool(name, getattr(_DEFAULTS, name))
    values["top_k"] = fields.get_int("top_k", _DEFAULTS.top_k)
    values["seed"] = fields.get_int(seed)
    values["min_new_tokens"] = fields.get_int(min_tokens, _DEFAULTS.min_new_tokens)
    values["no_stop_trim"] = fields.get_bool(no_stop_trim, _DEFAULTS.no_stop_trim)
    values["stop"] = fields.get_strs("stop")
    values["stop_token_ids"] = fields.get_token_ids("stop_token_ids")
    values["logit_bias"] = read_logit_bias(fields)
    return values


def read_logit_bias(fields: Fields) -> tuple[tuple[int, float], ...]:
    """OpenAI's (and SGLang's) logit_bias: {"<token id>": bias}, as (id, bias) pairs in id order
    (requests asking the same share a spec); the ids are checked against the vocabulary and
    the biases' range in SamplingParams.validate()."""
    bias = fields.get_object("logit_bias")
    if bias is None or not bias.obj:
        return ()
    param = fields.param("logit_bias")
    if len(bias.obj) > MAX_LOGIT_BIAS:  # before a loop over what a client may make huge
        raise bad_request(f"{param} may name at most {MAX_LOGIT_BIAS} tokens", param)
    bad_keys = [k for k in bias.obj if not (k.isascii() and k.lstrip("-").isdigit() and len(k) <= 20)]
    if bad_keys:  # all of them at once, as vLLM names them
        raise bad_request(f"{param} keys must be token ids as integer strings, not {_some(bad_keys)}", param)
    bad_values = [k for k, v in bias.obj.items() if type(v) not in (int, float)]
    if bad_values:
        raise bad_request(f"{param} values must be numbers, not so for token ids {_some(bad_values)}", param)
    return tuple(sorted((int(k), float(v)) for k, v in bias.obj.items()))


def _some(keys: list[str], most: int = 8) -> str:
    """A few of a client's keys, each cut short, for a message."""
    return ", ".join(repr(k[:40]) for k in keys[:most]) + (", ..." if len(keys) > most else "")


def read_allowed_token_ids(fields: Fields) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: the only tokens the answer may hold, a non-empty list (checked
    against the vocabulary in SamplingParams.validate()), in id order without repeats."""
    raw = fields.raw("allowed_token_ids")
    param = fields.param("allowed_token_ids")
    if type(raw) is list and len(raw) > MAX_ALLOWED_TOKEN_IDS:  # before a pass over what a client may make huge
        raise bad_request(f"{param} may name at most {MAX_ALLOWED_TOKEN_IDS} tokens", param)
    ids = fields.get_token_ids("allowed_token_ids")
    if raw is not None and not ids:
        raise bad_request(f"{param} must name at least one token", param)
    return tuple(sorted(set(ids)))


def read_logprob_token_ids(fields: Fields, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
    """vLLM's logprob_token_ids: the tokens whose logprobs each position reports instead of its
    top_logprobs most likely ones (the sampled token's is added where it is not among them), in
    the client's order without repeats. As SamplingParams arguments: the ids, and top_logprobs
    (their count) and logprobs as given."""
    raw = fields.raw("logprob_token_ids")
    param = fields.param("logprob_token_ids")
    if type(raw) is list and len(raw) > MAX_TOP_LOGPROBS:  # before a pass over what a client may make huge
        raise bad_request(f"{param} may name at most {MAX_TOP_LOGPROBS} tokens", param)
    ids = tuple(dict.fromkeys(fields.get_token_ids("logprob_token_ids")))
    if not ids:
        return {"logprobs": logprobs, "top_logprobs": top_logprobs}
    if not logprobs:
        raise bad_request(f"{param} needs logprobs: it names the tokens whose logprobs are returned", param)
    return {"logprobs": True, "top_logprobs": len(ids), "logprob_token_ids": ids}


def check_max_logprobs(params: SamplingParams, names: Mapping[str, str], max_logprobs: int, prompt_len: int) -> None:
    """vLLM's --max-logprobs: a 400 naming the field that asks more logprobs per position than
    `max_logprobs` (-1: the whole vocabulary); and one naming the field that asks the most when
    the choice's alternatives in all are more than MAX_LOGPROB_ENTRIES."""
    asks = {"top_logprobs": params.top_logprobs, "prompt_logprobs": params.prompt_logprobs}
    for name, asked in asks.items():
        if max_logprobs >= 0 and asked > max_logprobs:
            param = _logprobs_param(params, names, name)
            raise bad_request(
                f"{param} asks for {asked} logprobs per position; this server returns at most {max_logprobs} "
                f"(--max-logprobs)",
                param,
            )
    entries = logprob_entries(params, prompt_len)
    if sum(entries.values()) > MAX_LOGPROB_ENTRIES:
        name = max(entries, key=entries.__getitem__)
        param = _logprobs_param(params, names, name)
        raise bad_request(
            f"{param}: {asks[name]} logprobs at each of {entries[name] // asks[name]} positions are "
            f"{sum(entries.values())} in all with the others asked; a request may ask at most "
            f"{MAX_LOGPROB_ENTRIES} (fewer per position, or fewer positions: max_tokens)",
            param,
        )


def logprob_entries(params: SamplingParams, prompt_len: int) -> dict[str, int]:
    """The logprobs alternatives one choice asks for, by the field that asks them."""
    return {
        "top_logprobs": params.top_logprobs * params.max_new_tokens,
        "prompt_logprobs": max(params.prompt_logprobs, 0) * (prompt_len - params.prompt_logprobs_start),
    }


def _logprobs_param(params: SamplingParams, names: Mapping[str, str], name: str) -> str:
    param = "logprob_token_ids" if name == "top_logprobs" and params.logprob_token_ids else name
    return names.get(param, param)


def validated(params: SamplingParams, names: Mapping[str, str], vocab_size: int | None = None) -> SamplingParams:
    try:
        return params.validate(vocab_size)
    except InvalidParam as e:
        raise from_invalid_param(e, names) from None


@dataclass(frozen=True)
class SamplingSpec:
    """A request's sampling before its prompt is tokenized. `max_tokens` None means "as
    many as the context leaves" (chat's default); resolve() decides it per prompt."""

    params: SamplingParams  # validated; its max_new_tokens is provisional while max_tokens is None
    max_tokens: int | None
    # validate()'s param names -> this endpoint's fields; also "grammar": the field the grammar
    # came from, and "compact_json": the field that asked for JSON without whitespace
    names: Mapping[str, str]
    prompt_param: str  # the field holding the prompt: messages, prompt, text, input_ids

    @classmethod
    def build(
        cls, values: dict[str, Any], max_tokens: int | None, names: Mapping[str, str], prompt_param: str
    ) -> SamplingSpec:
        """values: read_sampling()'s. Without max_tokens, everything else is validated now
        (min_tokens against itself) and min_tokens against the real budget in resolve().
        Requests asking the same get the same spec, made once rather than a request (clients
        send a few distinct settings), and so the same SamplingParams, whose record bytes
        pack_request makes once too."""
        stop, grammar = values["stop"], values.get("grammar", "")
        if len(stop) > MAX_STOP_STRINGS or sum(map(len, stop)) > MAX_STOP_BYTES or len(grammar) > MAX_GRAMMAR_BYTES:
            return _spec(values, max_tokens, dict(names), prompt_param)  # refused: not worth hashing
        key = (tuple(values.items()), max_tokens, tuple(names.items()), prompt_param)
        spec = _SPECS.get(key)
        if spec is None:
            spec = _spec(values, max_tokens, dict(names), prompt_param)
            # bounded by bytes: the stop strings, the grammar and the bias are the client's
            cost = string_bytes((*stop, grammar)) + LOGIT_BIAS_ENTRY_BYTES * len(values.get("logit_bias", ()))
            cost += 8 * len(values.get("allowed_token_ids", ()))
            _SPECS.put(key, spec, cost)
        return spec

    def resolve(
        self, prompt_ids: Sequence[int] | np.ndarray, context_len: int, vocab_size: int, kv_tokens: int | None = None
    ) -> SamplingParams:
        """The final SamplingParams for one tokenized prompt; raises APIError(400). kv_tokens:
        the engine's KV cache in tokens, when it may hold less than the context."""
        check_prompt(prompt_ids, context_len, vocab_size, self.prompt_param, kv_tokens)
        if self.params.prompt_logprobs >= 0 and self.params.prompt_logprobs_start >= len(prompt_ids):
            param = self.names.get("prompt_logprobs_start", "prompt_logprobs_start")
            raise bad_request(f"{param} must be a position in the prompt, which has {len(prompt_ids)} tokens", param)
        max_new = resolve_max_tokens(
            self.max_tokens, len(prompt_ids), context_len, self.names.get("max_tokens", "max_tokens")
        )
        p = self.params
        whole = max(p.top_logprobs, p.prompt_logprobs) > MAX_TOP_LOGPROBS  # counts the vocabulary bounds
        if max_new == p.max_new_tokens and not (
            p.stop_token_ids or p.logit_bias or p.allowed_token_ids or p.logprob_token_ids or whole
        ):
            return p  # validated in build(): only max_tokens and the vocabulary's checks are left
        params = dataclasses.replace(p, max_new_tokens=max_new)
        if whole:
            params = dataclasses.replace(
                params,
                top_logprobs=vocab_size if p.top_logprobs == WHOLE_VOCABULARY else p.top_logprobs,
                prompt_logprobs=vocab_size if p.prompt_logprobs == WHOLE_VOCABULARY else p.prompt_logprobs,
            )
        return validated(params, self.names, vocab_size)  # again: token ids need the vocabulary

    @property
    def grammar_param(self) -> str:
        """The field the request's grammar came from (response_format.json_schema.schema, ...)."""
        return self.names.get("grammar", "grammar")

    def grammar_checked(self, any_whitespace: bool) -> bool:
        """Whether check_grammar() costs a lookup now (else a caller on an event loop runs it in a thread)."""
        p = self.params
        return not p.constrained or is_checked(p.grammar_kind, p.grammar, any_whitespace)

    def check_grammar(self, grammar_backend: str, any_whitespace: bool) -> None:
        """Raises APIError(400) naming the grammar's field when the server has no grammar backend
        or xgrammar cannot parse the grammar; before any engine work, so the client gets a 400
        rather than an engine error inside a stream."""
        p = self.params
        if not p.constrained:
            return
        param = self.grammar_param
        if grammar_backend == "none":
            raise bad_request(f"{param}: structured output is off on this server (--grammar-backend none)", param)
        compact = self.names.get("compact_json")
        if compact is not None and any_whitespace:
            raise bad_request(
                f"{compact}: this server's JSON grammars allow any whitespace (--constrained-json-any-whitespace), "
                f"which a request cannot turn off",
                compact,
            )
        try:
            check_grammar(p.grammar_kind, p.grammar, any_whitespace)
        except InvalidGrammar as e:
            raise bad_request(f"{param} is not a valid grammar: {e.message}", param) from None


_SPECS = ByteLRU(MEMO_BYTES)  # clients send a few distinct settings
LOGIT_BIAS_ENTRY_BYTES = 128  # an (id, bias) pair's objects


def _spec(values: dict[str, Any], max_tokens: int | None, names: Mapping[str, str], prompt_param: str) -> SamplingSpec:
    provisional = max_tokens if max_tokens is not None else max(values["min_new_tokens"], 1)
    return SamplingSpec(
        validated(SamplingParams(**values, max_new_tokens=provisional), names), max_tokens, names, prompt_param
    )


def check_prompt(
    prompt_ids: Sequence[int] | np.ndarray, context_len: int, vocab_size: int, param: str, kv_tokens: int | None = None
) -> None:
    """A prompt must have a token, fit the context and the KV cache with room for one more,
    and use the vocabulary."""
    n = len(prompt_ids)
    if n == 0:
        raise bad_request(f"{param} is empty: the prompt must have at least one token", param)
    # SGLang's words, which its clients look for: "is longer than the model's context length"
    if n >= context_len:
        raise bad_request(
            f"The input ({n} tokens, {param}) is longer than the model's context length ({context_len} tokens) "
            f"allows: no room is left to generate. Shorten the prompt.",
            param,
            code="context_length_exceeded",
        )
    # the KV cache may hold less than the context: the scheduler would reject such a prompt, after a stream began
    if kv_tokens is not None and n >= kv_tokens:
        raise bad_request(
            f"This server's KV cache holds {kv_tokens} tokens, and the prompt ({param}) has {n} tokens, which "
            f"leaves no room to generate. Shorten the prompt.",
            param,
            code="context_length_exceeded",
        )
    check_token_ids(prompt_ids, vocab_size, param)


def check_prompt_chars(n_chars: int, max_chars: int, param: str) -> None:
    """A prompt text longer than `max_chars` (the context's tokens times the most characters a
    token holds) cannot fit the context, however it tokenizes: refused before tokenizing it."""
    if n_chars > max_chars:
        raise bad_request(
            f"The prompt ({param}) has {n_chars} characters, more than this model's context can hold "
            f"({max_chars} characters at most). Shorten the prompt.",
            param,
            code="context_length_exceeded",
        )


def check_request_size(
    prompt_lens: Sequence[int],
    params: Sequence[SamplingParams],
    n: int,
    prompt_param: str,
    n_param: str = "n",
    stop_param: str = "stop",
    max_tokens: int | None = None,
) -> None:
    """What one request (n choices of each prompt, prompt_lens[i] tokens and params[i]) asks of
    the engine at once must fit it: its prompts' tokens in all (max_tokens: the KV cache's,
    when known), its records' payload (prompt ids, stop strings, grammar, logit bias) in the
    REQUEST ring, their OPEN records' stop strings in the TOKEN_OUT ring (protocol/records.py).
    Refused with a 400 naming `n` when one choice of each prompt would fit, else the prompt or
    the stop strings (a grammar and a bias are bounded below what one choice may take)."""
    tokens = sum(prompt_lens)
    stops = sum(stop_payload_bytes(p) for p in params)
    payload = 4 * tokens + sum(sampling_payload_bytes(p) for p in params) + 4 * len(params)  # + alignment
    for total, limit, what, param in (
        (tokens, max_tokens, "prompt tokens", prompt_param),
        (
            payload,
            MAX_REQUEST_PAYLOAD_BYTES,
            "bytes of prompt token ids, stop strings and grammars",
            stop_param if stops > 4 * tokens else prompt_param,
        ),
        (stops, MAX_OPEN_PAYLOAD_BYTES, "bytes of stop strings", stop_param),
    ):
        if limit is not None and total * n > limit:
            named = n_param if n > 1 and total <= limit else param
            raise bad_request(
                f"The request asks for {total * n} {what} ({total} x {n_param} {n}); this server takes at "
                f"most {limit} in one request. Lower {n_param}, or shorten the prompt or the stop strings.",
                named,
            )


def check_token_ids(token_ids: Sequence[int] | np.ndarray, vocab_size: int, param: str) -> None:
    """Ids from the client (parsed as non-negative) must be in the vocabulary (/detokenize too)."""
    if len(token_ids) == 0:
        return
    top = int(token_ids.max()) if isinstance(token_ids, np.ndarray) else max(token_ids)
    if top >= vocab_size:
        raise bad_request(f"{param} has token id {top}, out of vocabulary (the model has {vocab_size} tokens)", param)


def resolve_max_tokens(max_tokens: int | None, prompt_len: int, context_len: int, param: str = "max_tokens") -> int:
    """max_tokens as asked, or all the context the prompt leaves when unset; a 400 naming
    `param` when prompt and completion together would not fit."""
    room = context_len - prompt_len
    if max_tokens is None:
        if room < 1:
            raise bad_request(
                f"The prompt has {prompt_len} tokens and fills this model's context of "
                f"{context_len} tokens; no room is left for {param}",
                param,
                code="context_length_exceeded",
            )
        return room
    if max_tokens > room:  # the words SGLang's clients look for (its releases have used both)
        too_large = (
            f"max_completion_tokens is too large: {max_tokens} ({param}). This model supports at most "
            f"{context_len} completion tokens. "
            if max_tokens > context_len
            else ""
        )
        raise bad_request(
            f"{too_large}Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens: you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion). Reduce the prompt or {param}.",
            param,
            code="context_length_exceeded",
        )
    return max_tokens
