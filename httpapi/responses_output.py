"""A Responses API answer: the `response` object, its output items (reasoning, message,
function calls) and the stream of its events (response.created ... response.completed).

The text is read as a chat choice's is (httpapi/chat_output.py): the same parsers make the
reasoning, the content and the calls, so a stream's deltas concatenate to the whole answer's
items, which the last event (and the stored response) carries. Item ids derive from the
response's, so a streamed and a stored answer name their items alike."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from httpapi.chat_output import ChatOutput, chat_message
from httpapi.errors import APIError
from httpapi.logprobs import LogprobVocab, TokenLogprobs, chat_logprobs

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@dataclass(frozen=True)
class ResponseUsage:
    input_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "input_tokens": self.input_tokens,
            # cache_write_tokens: OpenAI's newer field, which its client's types require; this
            # server's prefix cache is automatic, with no writes a client asks (or pays) for
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


@dataclass
class ResponseHead:
    """What every state of one response shares: its id, when it was made, the model, and the
    request's fields the object repeats (instructions, tools, text, metadata, ...)."""

    id: str
    model: str
    echo: dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))
    # a namespace's function as the model calls it ("<namespace>__<name>") -> (namespace, name)
    call_names: dict[str, tuple[str, str]] = field(default_factory=dict)

    def call_item(self, index: int, call_id: str, called: str, arguments: str, status: str) -> dict:
        """A function_call item for the model's call of `called` (a namespace's: its name and
        namespace apart, as vLLM and OpenAI answer)."""
        namespace, name = self.call_names.get(called, (None, called))
        return function_call_item(self.item_id("fc", index), call_id, name, arguments, status, namespace)

    def item_id(self, kind: str, index: int = 0) -> str:
        """ "msg_<the response's hex>", "rs_...", "fc_..._<index>"."""
        base = f"{kind}_{self.id.removeprefix('resp_')}"
        return f"{base}_{index}" if kind == "fc" else base

    def response(
        self,
        status: str,
        output: list[dict],
        usage: ResponseUsage | None = None,
        incomplete_reason: str | None = None,
        error: APIError | None = None,
        raw: dict | None = None,
    ) -> dict:
        """`raw`: vLLM's input_messages and output_messages (raw_messages), when asked."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None if error is None else {"code": error.code or "server_error", "message": error.message},
            "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
            "model": self.model,
            "output": output,
            "usage": None if usage is None else usage.as_dict(),
            "temperature": self.echo.get("temperature"),
            "top_p": self.echo.get("top_p"),
            "max_output_tokens": self.echo.get("max_output_tokens"),
            **{k: v for k, v in self.echo.items() if k not in ("temperature", "top_p", "max_output_tokens")},
            **(raw or {}),
        }


def raw_messages(prompt: str, prompt_ids: list[int], output: str, output_ids: list[int]) -> dict:
    """vLLM's enable_response_messages: the prompt as the model read it (the chat template's
    text and its token ids) and the raw output (its text before any parser, and its ids)."""

    def message(text: str, ids: list[int]) -> dict:
        return {"type": "raw_message_tokens", "message": text, "tokens": ids}

    return {
        "input_messages": [message(prompt, prompt_ids)],
        "output_messages": [message(output, output_ids)] if output or output_ids else [],
    }


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """(the response's status, incomplete_details.reason) for its choice's finish_reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def output_items(
    head: ResponseHead,
    text: str,
    finish_reason: str | None,
    out: ChatOutput,
    logprobs: list[dict] | None,
) -> tuple[list[dict], str]:
    """The whole answer's output items, and its reasoning's text (whose tokens usage counts)."""
    message, _ = ({"content": text}, None) if out.plain else chat_message(text, finish_reason, out)
    status = "incomplete" if finish_reason == "length" else "completed"
    items: list[dict] = []
    reasoning = message.get("reasoning_content") or ""
    if reasoning:
        items.append(reasoning_item(head.item_id("rs"), reasoning, status))
    content = message.get("content")
    if content or not message.get("tool_calls"):
        items.append(message_item(head.item_id("msg"), content or "", logprobs, status))
    for i, call in enumerate(message.get("tool_calls") or ()):
        fn = call["function"]
        items.append(head.call_item(i, call["id"], fn["name"], fn["arguments"], status))
    return items, reasoning


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
        "status": status,
    }


def output_text_part(text: str, logprobs: list[dict] | None) -> dict:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, text: str, logprobs: list[dict] | None, status: str) -> dict:
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text, logprobs)],
    }


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str, namespace: str | None = None
) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        **({"namespace": namespace} if namespace is not None else {}),
        "arguments": arguments,
        "status": status,
    }


def response_logprobs(lp: TokenLogprobs | None, vocab: LogprobVocab | None) -> list[dict] | None:
    """A text part's logprobs ([{token, logprob, bytes, top_logprobs}]), as chat's content list."""
    if lp is None or vocab is None:
        return None
    return chat_logprobs(lp, vocab)["content"]


class ResponseEvents:
    """One streamed response's SSE events, from its chat deltas (ChatDeltas.feed/finish): each
    kind of delta opens its item (output_item.added, content_part.added), streams into it
    (reasoning_text / output_text / function_call_arguments deltas) and is closed (its .done
    events) when another kind begins or the answer ends. Every event has its sequence_number;
    the items as closed make the final response's output."""

    def __init__(self, head: ResponseHead, vocab: LogprobVocab | None, with_logprobs: bool) -> None:
        self.head = head
        self.vocab = vocab
        self.with_logprobs = with_logprobs
        self.sequence = 0
        self.output: list[dict] = []  # closed items
        self.open: dict | None = None  # the item being streamed: its output's last entry once closed
        self.open_call = -1  # the open function call's index among the answer's calls
        self.text: list[str] = []  # the open item's text (or arguments) so far
        self.logprobs: list[dict] = []  # the open message's logprobs so far
        self.reasoning = ""  # the whole reasoning text, for usage's reasoning_tokens
        self.pending: list[dict] = []  # logprobs of tokens no output text delta has carried yet

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def start(self) -> bytes:
        response = self.head.response("in_progress", [])
        return self.event("response.created", response=response) + self.event("response.in_progress", response=response)

    def feed(self, deltas: list[dict], lp: TokenLogprobs | None) -> bytes:
        """The events of one take's chat deltas. Its tokens' logprobs go with the next output
        text delta (this take's or a later one: text held back, or reasoning, has none), so
        that the streamed logprobs are the whole response's, every token's."""
        events = []
        if self.with_logprobs:
            self.pending += response_logprobs(lp, self.vocab) or []
        for delta in deltas:
            if "reasoning_content" in delta:
                events += self._text("reasoning", delta["reasoning_content"], None)
            elif "content" in delta:
                events += self._text("message", delta["content"], self.pending if self.with_logprobs else None)
                self.pending = []
            else:
                call = delta["tool_calls"][0]
                function = call["function"]
                if "id" in call:
                    events += self._open_call(call["index"], call["id"], function["name"])
                elif function.get("arguments"):
                    events.append(self._arguments(function["arguments"]))
        return b"".join(events)

    def finish(
        self, finish_reason: str | None, usage: ResponseUsage, error: APIError | None = None, raw: dict | None = None
    ) -> tuple[bytes, dict]:
        """The closing events and the final response object (what is stored); `raw`: its
        raw_messages, when asked."""
        status, reason = status_of(finish_reason)
        item_status = "incomplete" if reason else "completed"
        events = [] if self.output or self.open is not None else self._open_text("message")  # an empty answer
        if self.pending and self.open is not None and self.open["type"] == "message":
            self.logprobs += self.pending  # the last tokens' (a stop string's): in the done event
        self.pending = []
        events += self._close(item_status)
        if error is not None:
            status = "failed"
        response = self.head.response(status, self.output, usage, reason, error, raw)
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(status, "response.incomplete")
        return b"".join(events) + self.event(kind, response=response), response

    def _text(self, kind: str, text: str, logprobs: list[dict] | None) -> list[bytes]:
        if not text:
            return []
        events = [] if self.open is not None and self.open["type"] == kind else self._close("completed")
        if self.open is None:
            events += self._open_text(kind)
        self.text.append(text)
        at = self._at()
        if kind == "reasoning":
            self.reasoning += text
            events.append(self.event("response.reasoning_text.delta", **at, content_index=0, delta=text))
        else:
            if logprobs is not None:
                self.logprobs += logprobs
            delta_logprobs = logprobs or []
            events.append(
                self.event("response.output_text.delta", **at, content_index=0, delta=text, logprobs=delta_logprobs)
            )
        return events

    def _open_text(self, kind: str) -> list[bytes]:
        if kind == "reasoning":
            self.open = {**reasoning_item(self.head.item_id("rs"), "", "in_progress"), "content": []}
            part: dict = {"type": "reasoning_text", "text": ""}
        else:
            self.open = {**message_item(self.head.item_id("msg"), "", None, "in_progress"), "content": []}
            part = output_text_part("", [] if self.with_logprobs else None)
        added = self.event("response.output_item.added", output_index=len(self.output), item=self.open)
        return [added, self.event("response.content_part.added", **self._at(), content_index=0, part=part)]

    def _open_call(self, index: int, call_id: str, name: str) -> list[bytes]:
        events = self._close("completed")
        self.open = self.head.call_item(index, call_id, name, "", "in_progress")
        self.open_call = index
        return [*events, self.event("response.output_item.added", output_index=len(self.output), item=self.open)]

    def _arguments(self, text: str) -> bytes:
        self.text.append(text)
        return self.event("response.function_call_arguments.delta", **self._at(), delta=text)

    def _at(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _close(self, status: str) -> list[bytes]:
        """The open item's .done events; it joins the output."""
        item = self.open
        if item is None:
            return []
        at, text = self._at(), "".join(self.text)
        events = []
        if item["type"] == "reasoning":
            part: dict = {"type": "reasoning_text", "text": text}
            events.append(self.event("response.reasoning_text.done", **at, content_index=0, text=text))
            events.append(self.event("response.content_part.done", **at, content_index=0, part=part))
            item = reasoning_item(item["id"], text, status)
        elif item["type"] == "message":
            logprobs = self.logprobs if self.with_logprobs else None
            part = output_text_part(text, logprobs)
            events.append(
                self.event("response.output_text.done", **at, content_index=0, text=text, logprobs=logprobs or [])
            )
            events.append(self.event("response.content_part.done", **at, content_index=0, part=part))
            item = message_item(item["id"], text, logprobs, status)
        else:
            events.append(self.event("response.function_call_arguments.done", **at, name=item["name"], arguments=text))
            item = {**item, "arguments": text, "status": status}
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open, self.text, self.logprobs = None, [], []
        return events
