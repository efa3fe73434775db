"""Non-streaming response bodies: chat.completion, text_completion and SGLang's /generate.

A route takes one ChoiceResult per choice (index i * n + j for the j-th sample of prompt i)
from the choices' states (choice_results) and hands them here in index order."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from httpapi.chat_output import ChatOutput, chat_message
from httpapi.logprobs import (
    LogprobVocab,
    PromptLogprobs,
    TokenLogprobs,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    need_vocab,
    sglang_logprobs,
    sglang_prompt_logprobs,
    vllm_prompt_logprobs,
)
from protocol.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort")


class RandomIds:
    """128 random bits an id, from one os.urandom call per 256 ids: the syscall cost more than
    the rest of an id. A process that forks refills its own pool (a pool copied into two
    processes would give both the same ids)."""

    ID_BYTES = 16
    POOL_BYTES = 4096

    def __init__(self) -> None:
        self._pool, self._at, self._pid = b"", 0, -1

    def next_hex(self) -> str:
        if self._at >= len(self._pool) or self._pid != os.getpid():
            self._pool, self._at, self._pid = os.urandom(self.POOL_BYTES), 0, os.getpid()
        at = self._at
        self._at = at + self.ID_BYTES
        return self._pool[at : at + self.ID_BYTES].hex()


_IDS = RandomIds()


def new_request_id(kind: str) -> str:
    """ "chatcmpl-<hex>" or "cmpl-<hex>", as OpenAI names its responses: 128 random bits, as
    uuid4().hex has (less 6 fixed bits) at a fraction of its cost."""
    return f"{kind}-{_IDS.next_hex()}"


def now() -> int:
    """The `created` field: Unix seconds."""
    return int(time.time())


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    @classmethod
    def combine(cls, per_choice: Sequence[Usage], n: int) -> Usage:
        """A request's usage from its choices' (in index order): the n samples of one prompt
        count that prompt once, as vLLM does."""
        firsts = per_choice[::n]
        return cls(
            sum(u.prompt_tokens for u in firsts),
            sum(u.completion_tokens for u in per_choice),
            sum(u.cached_tokens for u in firsts),
        )


@dataclass(frozen=True)
class ChoiceResult:
    index: int
    text: str  # what the client sees: for echo, the prompt's text and then the completion
    finish_reason: str | None  # stop | length | abort; None in a stream's partial choice
    usage: Usage  # this choice's own counts
    logprobs: TokenLogprobs | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it (/generate)
    e2e_latency: float | None = None  # seconds from arrival to its end, once finished (/generate)
    output_ids: list[int] | None = None  # its token ids so far (/generate)
    prompt_logprobs: PromptLogprobs | None = None  # when asked (SamplingParams.prompt_logprobs)


class _Request(Protocol):
    @property
    def arrival_ns(self) -> int: ...


class ChoiceState(Protocol):
    """A choice as the engine side keeps it (runtime/http_worker/req_state.py's ReqState):
    what its results are read from."""

    index: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_ids: list[int]

    @property
    def group(self) -> _Request: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def matched_stop(self) -> int | str | None: ...

    def take(self) -> tuple[str, TokenLogprobs | None, str | None]: ...

    def take_prompt_logprobs(self) -> PromptLogprobs | None: ...


def choice_results(states: Sequence[ChoiceState], prefixes: list[str] | None = None) -> list[ChoiceResult]:
    """Each finished choice's result, what it has not taken yet; `prefixes`: each choice's
    text starts with its own (an echoed prompt)."""
    results = []
    for state in states:
        text, lp, finish = state.take()
        if prefixes is not None:
            text = prefixes[state.index] + text
        results.append(
            ChoiceResult(
                state.index,
                text,
                finish,
                usage_of(state),
                lp,
                state.matched_stop,
                e2e_latency(state),
                output_ids_of(state),
                state.take_prompt_logprobs(),
            )
        )
    return results


def output_ids_of(state: ChoiceState) -> list[int] | None:
    return state.output_ids if state.params.return_ids else None


def e2e_latency(state: ChoiceState) -> float:
    """Seconds from the request's arrival to now (its end, when asked of a finished choice)."""
    return (time.monotonic_ns() - state.group.arrival_ns) * 1e-9


def per_request_metrics(received_ns: int, submitted_ns: int, first_ns: int, end_ns: int, tokens: int) -> dict:
    """vLLM's per-request `metrics` (--enable-per-request-metrics) from the HTTP side's clock:
    the request's arrival, its submission to the engine, its first token, its end. The queue is
    the HTTP side's (parsing, the template, tokenizing); the scheduler's own wait falls in the
    time to first token, as the prefill does. A field whose times are missing is left out, and
    the mean inter-token latency needs two tokens (vLLM's)."""
    ms = 1e-6
    out = {"queue_time_ms": max(submitted_ns - received_ns, 0) * ms}
    if first_ns:
        out["time_to_first_token_ms"] = (first_ns - submitted_ns) * ms
        out["generation_time_ms"] = (end_ns - first_ns) * ms
        if tokens > 1:
            out["mean_itl_ms"] = (end_ns - first_ns) * ms / (tokens - 1)
    if end_ns > submitted_ns:
        out["tokens_per_second"] = tokens / ((end_ns - submitted_ns) * 1e-9)
    return out


def usage_of(state: ChoiceState) -> Usage:
    return Usage(state.prompt_tokens, state.completion_tokens, state.cached_tokens)


def chat_completion_body(
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceResult],
    n: int,
    vocab: LogprobVocab | None = None,
    output: ChatOutput | None = None,
    prompt_token_ids: list[int] | None = None,
) -> bytes:
    """`vocab` is needed when the choices carry logprobs; `output` reads their texts for
    reasoning and tool calls (none: all content). Prompt logprobs are the response's, as vLLM
    reports them for chat (its choices share the prompt). `prompt_token_ids`: vLLM's
    return_token_ids (each choice then has its token_ids)."""
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_chat_choice(c, vocab, output) for c in choices],
        "usage": Usage.combine([c.usage for c in choices], n).as_dict(),
        # vLLM's: the keys are always there, null unless asked (its clients read them unchecked)
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
    }
    if choices and choices[0].prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs, need_vocab(vocab))
    return orjson.dumps(body)


def _chat_choice(c: ChoiceResult, vocab: LogprobVocab | None, output: ChatOutput | None) -> dict:
    if output is None or output.plain:
        message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
    else:
        message, finish_reason = chat_message(c.text, c.finish_reason, output)
    return {
        "index": c.index,
        "message": message,
        "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs, need_vocab(vocab)),
        "finish_reason": finish_reason,
        "matched_stop": c.matched_stop,  # SGLang's: the stop string or token id that ended the choice
        **({"token_ids": c.output_ids} if c.output_ids is not None else {}),
    }


def completion_body(
    request_id: str,
    created: int,
    model: str,
    choices: Sequence[ChoiceResult],
    n: int,
    vocab: LogprobVocab | None = None,
    echo: bool = False,
    prompt_token_ids: list[list[int]] | None = None,
) -> bytes:
    """`echo`: the choices' texts start with their prompts, and so do their logprobs when asked
    (the prompt's logprobs then come with the choice: SamplingParams.prompt_logprobs).
    `prompt_token_ids`: each prompt's, for vLLM's return_token_ids (on its n choices, with
    their token_ids)."""
    return orjson.dumps(
        {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                completion_choice(c, vocab, echo, None if prompt_token_ids is None else prompt_token_ids[c.index // n])
                for c in choices
            ],
            "usage": Usage.combine([c.usage for c in choices], n).as_dict(),
        }
    )


def completion_choice(
    c: ChoiceResult, vocab: LogprobVocab | None, echo: bool, prompt_token_ids: list[int] | None = None
) -> dict:
    """One text_completion choice; vLLM's prompt_logprobs on it when the choice carries them."""
    logprobs = None
    if c.logprobs is not None:
        if echo and c.prompt_logprobs is not None:
            logprobs = echoed_logprobs(c.prompt_logprobs, c.logprobs, need_vocab(vocab))[0]
        else:
            logprobs = completion_logprobs(c.logprobs, need_vocab(vocab), 0)[0]
    choice = {
        "index": c.index,
        "text": c.text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "matched_stop": c.matched_stop,  # SGLang's: the stop string or token id that ended the choice
        # vLLM's: the keys are always there, null unless asked (return_token_ids, prompt_logprobs)
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
    }
    if prompt_token_ids is not None:
        choice["token_ids"] = c.output_ids
    if c.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs, need_vocab(vocab))
    return choice


def generate_output(
    rid: str, choice: ChoiceResult, vocab: LogprobVocab | None = None, return_text_in_logprobs: bool = False
) -> dict:
    """One SGLang /generate output: {"text", "output_ids", "meta_info"}; a stream sends partial
    choices (SGLang's default: the text and ids so far)."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": sglang_finish_reason(choice),
        "prompt_tokens": choice.usage.prompt_tokens,
        "completion_tokens": choice.usage.completion_tokens,
        "cached_tokens": choice.usage.cached_tokens,
    }
    if choice.e2e_latency is not None:
        meta["e2e_latency"] = choice.e2e_latency
    if choice.logprobs is not None:
        tokens, top = sglang_logprobs(choice.logprobs, need_vocab(vocab), return_text_in_logprobs)
        meta["output_token_logprobs"] = tokens
        meta["output_top_logprobs"] = top
    if choice.prompt_logprobs is not None:
        tokens, top = sglang_prompt_logprobs(choice.prompt_logprobs, need_vocab(vocab), return_text_in_logprobs)
        meta["input_token_logprobs"] = tokens
        if choice.prompt_logprobs.top_ids.shape[1]:  # SGLang: only with top_logprobs_num > 0
            meta["input_top_logprobs"] = top
    out: dict[str, Any] = {"text": choice.text, "meta_info": meta}
    if choice.output_ids is not None:
        out["output_ids"] = choice.output_ids
    return out


def generate_body(
    rids: Sequence[str],
    choices: Sequence[ChoiceResult],
    batch: bool,
    vocab: LogprobVocab | None = None,
    return_text_in_logprobs: bool = False,
) -> bytes:
    """SGLang's /generate answer: one output, or a list of them for a batch (or n > 1);
    `rids` has one id per choice."""
    outputs = [generate_output(rid, c, vocab, return_text_in_logprobs) for rid, c in zip(rids, choices)]
    return orjson.dumps(outputs if batch else outputs[0])


def sglang_finish_reason(choice: ChoiceResult) -> dict | None:
    """SGLang's {"type": "stop", "matched": ...} / {"type": "length", "length": ...} / {"type": "abort"};
    None while the choice runs."""
    reason = choice.finish_reason
    if reason == "stop":
        return {"type": "stop", "matched": choice.matched_stop}
    if reason == "length":
        return {"type": "length", "length": choice.usage.completion_tokens}
    return None if reason is None else {"type": reason}
