"""Server-sent events for streamed responses.

One stream object per request: the bytes that do not change during a request (id,
object, created, model, each choice's index) are encoded once when it starts, so an
event costs one orjson.dumps of the delta text and one join. One event may carry a
delta of several tokens: the TokenizerManager coalesces a client's pending deltas
when the client falls behind.

Event order for the OpenAI endpoints:
    start()                      chat only: a role chunk per choice
    delta(index, text, ...)      any number, finish_reason on each choice's last
    usage(Usage)                 only with stream_options.include_usage (and with
                                 continuous_usage_stats, each chunk carries its own: with_usage)
    DONE
and on a failure mid-stream: error_event(APIError), then DONE.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from httpapi.errors import APIError
from httpapi.logprobs import (
    LogprobVocab,
    PromptLogprobs,
    TokenLogprobs,
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    need_vocab,
    vllm_prompt_logprobs,
)
from httpapi.responses import FINISH_REASONS, ChoiceResult, Usage, generate_output

DONE = b"data: [DONE]\n\n"
HEADERS = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache", "x-accel-buffering": "no"}

_REASONS: dict[str | None, bytes] = {None: b"null", **{r: b'"' + r.encode() + b'"' for r in FINISH_REASONS}}
# what closes a delta without logprobs, by finish reason: a chat delta, a completion's text
_CHAT_CLOSE = {r: b'},"logprobs":null,"finish_reason":' + enc + b"}]}\n\n" for r, enc in _REASONS.items()}
_COMPLETION_CLOSE = {r: b',"logprobs":null,"finish_reason":' + enc + b"}]}\n\n" for r, enc in _REASONS.items()}


def with_choice_field(chunk: bytes, finish_reason: str | None, key: str, value: object) -> bytes:
    """`chunk`, an OpenAI event of one choice, with `key` on that choice, beside its
    finish_reason (whose bytes find it: inside a JSON string a quote is escaped, so the text
    cannot hold them)."""
    field = b'"finish_reason":' + orjson.dumps(finish_reason)  # tool_calls too, beside _REASONS
    at = chunk.rindex(field) + len(field)
    return chunk[:at] + b',"' + key.encode() + b'":' + orjson.dumps(value) + chunk[at:]


def with_matched_stop(chunk: bytes, finish_reason: str | None, matched_stop: int | str | None) -> bytes:
    """`chunk` with SGLang's matched_stop on its choice when it finishes it (finish_reason
    set): the stop string or token id that ended the choice, else null."""
    if finish_reason is None:
        return chunk
    return with_choice_field(chunk, finish_reason, "matched_stop", matched_stop)


def with_field(chunk: bytes, key: str, value: object) -> bytes:
    """`chunk`, one OpenAI event, with `key` at its top level."""
    return chunk[: -len(b"}\n\n")] + b',"' + key.encode() + b'":' + orjson.dumps(value) + b"}\n\n"


def with_usage(chunk: bytes, usage: Usage) -> bytes:
    """`chunk` with a usage of its own: vLLM's continuous_usage_stats (its choice's completion
    tokens so far)."""
    return with_field(chunk, "usage", usage.as_dict())


def error_event(err: APIError) -> bytes:
    return b"data: " + err.body() + b"\n\n"


class _OpenAIStream:
    def __init__(self, request_id: str, created: int, model: str, object_name: str) -> None:
        self._head = b"".join(
            (
                b'data: {"id":',
                orjson.dumps(request_id),
                b',"object":"',
                object_name.encode(),
                b'","created":',
                str(created).encode(),
                b',"model":',
                orjson.dumps(model),
                b",",
            )
        )

    def usage(self, usage: Usage) -> bytes:
        """The last chunk before DONE with stream_options.include_usage: no choices, the usage."""
        return b"".join((self._head, b'"choices":[],"usage":', orjson.dumps(usage.as_dict()), b"}\n\n"))


class ChatStream(_OpenAIStream):
    """chat.completion.chunk events; `vocab` is needed when deltas carry logprobs."""

    def __init__(
        self, request_id: str, created: int, model: str, n_choices: int, vocab: LogprobVocab | None = None
    ) -> None:
        super().__init__(request_id, created, model, "chat.completion.chunk")
        self._vocab = vocab
        self._open = [self._head + b'"choices":[{"index":%d,"delta":{"content":' % i for i in range(n_choices)]

    def start(self, usages: Sequence[Usage] | None = None) -> bytes:
        """The first chunk of every choice: role "assistant", empty content; `usages`: each
        choice's own usage on it (continuous_usage_stats)."""
        chunks = [
            self._head + b'"choices":[{"index":%d,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n' % i
            for i in range(len(self._open))
        ]
        if usages is not None:
            chunks = [with_usage(c, u) for c, u in zip(chunks, usages)]
        return b"".join(chunks)

    def prompt_delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None,
        prompt_logprobs: PromptLogprobs | None,
        echo: str | None,
        matched_stop: int | str | None = None,
    ) -> bytes:
        """A choice's first delta when it carries prompt logprobs: vLLM's prompt_logprobs on the
        chunk, as on its non-streamed chat response (a chat prompt is never echoed)."""
        chunk = with_matched_stop(self.delta(index, text, finish_reason, logprobs), finish_reason, matched_stop)
        return self.with_prompt_logprobs(chunk, prompt_logprobs)

    def with_prompt_logprobs(self, chunk: bytes, prompt_logprobs: PromptLogprobs | None) -> bytes:
        """`chunk` (one event of this stream) with vLLM's prompt_logprobs on it."""
        if prompt_logprobs is None:
            return chunk
        field = b',"prompt_logprobs":' + orjson.dumps(vllm_prompt_logprobs(prompt_logprobs, need_vocab(self._vocab)))
        return chunk[: -len(b"}\n\n")] + field + b"}\n\n"

    def delta(
        self, index: int, text: str, finish_reason: str | None = None, logprobs: TokenLogprobs | None = None
    ) -> bytes:
        if logprobs is None:
            return b"".join((self._open[index], orjson.dumps(text), _CHAT_CLOSE[finish_reason]))
        return b"".join(
            (
                self._open[index],
                orjson.dumps(text),
                b'},"logprobs":',
                orjson.dumps(chat_logprobs(logprobs, need_vocab(self._vocab))),
                b',"finish_reason":',
                _REASONS[finish_reason],
                b"}]}\n\n",
            )
        )

    def event(
        self, index: int, delta: dict, finish_reason: str | None = None, logprobs: TokenLogprobs | None = None
    ) -> bytes:
        """A chunk with any delta object (reasoning_content, tool_calls: httpapi/chat_output.py);
        `delta` may be empty, for a chunk that only carries logprobs or the finish_reason."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else chat_logprobs(logprobs, need_vocab(self._vocab)),
            "finish_reason": finish_reason,
        }
        return b"".join((self._head, b'"choices":[', orjson.dumps(choice), b"]}\n\n"))


class CompletionStream(_OpenAIStream):
    """text_completion events; `vocab` is needed when deltas carry logprobs."""

    def __init__(
        self, request_id: str, created: int, model: str, n_choices: int, vocab: LogprobVocab | None = None
    ) -> None:
        super().__init__(request_id, created, model, "text_completion")
        self._vocab = vocab
        self._open = [self._head + b'"choices":[{"index":%d,"text":' % i for i in range(n_choices)]
        self._text_offset = [0] * n_choices  # where each choice's next token's text starts
        self.echo_logprobs = False  # echo with logprobs: a choice's first delta's logprobs start with its prompt's

    def prompt_delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: TokenLogprobs | None,
        prompt_logprobs: PromptLogprobs | None,
        echo: str | None,
        matched_stop: int | str | None = None,
    ) -> bytes:
        """A choice's first delta when its prompt is echoed or its prompt logprobs came: the
        echoed text before the delta's, its prompt's logprobs before the delta's (echo with
        logprobs, text offsets continuing), and vLLM's prompt_logprobs on the choice."""
        choice: dict = {"index": index, "text": (echo or "") + text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["matched_stop"] = matched_stop
        if echo is not None and self.echo_logprobs and prompt_logprobs is not None:
            choice["logprobs"], self._text_offset[index] = echoed_logprobs(
                prompt_logprobs, logprobs, need_vocab(self._vocab)
            )
        elif logprobs is not None:
            choice["logprobs"], self._text_offset[index] = completion_logprobs(
                logprobs, need_vocab(self._vocab), self._text_offset[index]
            )
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs, need_vocab(self._vocab))
        return b"".join((self._head, b'"choices":[', orjson.dumps(choice), b"]}\n\n"))

    def delta(
        self, index: int, text: str, finish_reason: str | None = None, logprobs: TokenLogprobs | None = None
    ) -> bytes:
        if logprobs is None:
            return b"".join((self._open[index], orjson.dumps(text), _COMPLETION_CLOSE[finish_reason]))
        lp, self._text_offset[index] = completion_logprobs(logprobs, need_vocab(self._vocab), self._text_offset[index])
        return b"".join(
            (
                self._open[index],
                orjson.dumps(text),
                b',"logprobs":',
                orjson.dumps(lp),
                b',"finish_reason":',
                _REASONS[finish_reason],
                b"}]}\n\n",
            )
        )


class GenerateStream:
    """SGLang's /generate stream: as SGLang does by default, each event carries the
    choice's whole text so far (and logprobs so far), its meta_info, and "index" when
    the request is a batch."""

    def __init__(
        self, rids: Sequence[str], batch: bool, vocab: LogprobVocab | None = None, return_text_in_logprobs: bool = False
    ) -> None:
        self._rids = rids
        self._batch = batch
        self._vocab = vocab
        self._return_text = return_text_in_logprobs
        self._text = [""] * len(rids)
        self._logprobs: list[list[TokenLogprobs]] = [[] for _ in rids]
        self._prompt: list[PromptLogprobs | None] = [None] * len(rids)  # each event repeats them, as the text

    def delta(
        self,
        index: int,
        text: str,
        usage: Usage,
        finish_reason: str | None = None,
        matched_stop: int | str | None = None,
        logprobs: TokenLogprobs | None = None,
        e2e_latency: float | None = None,
        output_ids: list[int] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> bytes:
        """`prompt_logprobs`: those received since the previous event (they all come before the first token)."""
        self._text[index] += text
        if prompt_logprobs is not None:
            old = self._prompt[index]
            self._prompt[index] = prompt_logprobs if old is None else PromptLogprobs.concat([old, prompt_logprobs])
        so_far = None
        if logprobs is not None:
            self._logprobs[index].append(logprobs)
            so_far = TokenLogprobs.concat(self._logprobs[index])
        choice = ChoiceResult(
            index,
            self._text[index],
            finish_reason,
            usage,
            so_far,
            matched_stop,
            e2e_latency,
            output_ids,
            self._prompt[index],
        )
        out = generate_output(self._rids[index], choice, self._vocab, self._return_text)
        if self._batch:
            out["index"] = index
        return b"data: " + orjson.dumps(out) + b"\n\n"
