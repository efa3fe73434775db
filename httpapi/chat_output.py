"""What a chat choice's text becomes in the answer: the `<think>` part as `reasoning_content`
and `reasoning` (the older name and vLLM's newer one; --reasoning-parser), tool calls as
`tool_calls` (parsed from the text with --tool-call-parser when tool_choice is "auto", or read
from the grammar-constrained JSON of a forced call), the rest as `content`; finish_reason
"tool_calls" when a choice that stopped made calls.

Whole (`chat_message`) and streamed (`ChatDeltas`) answers agree: a stream's content,
reasoning and each call's argument deltas concatenate to the whole answer's fields, because
both run the same parsers (structured/ guarantees it of each). A forced call's JSON is read as
it arrives (structured/forced_calls.py): a stream sends each call's name once it is complete and
its arguments as they grow."""

from __future__ import annotations

from dataclasses import dataclass

from structured.forced_calls import ForcedCalls
from structured.reasoning import ReasoningParser
from structured.tool_parsers import ArgumentsDelta, CallStart, ContentDelta, ToolCall, ToolCallParser, call_id
from structured.tools import Tool, ToolChoice


@dataclass(frozen=True)
class ChatOutput:
    """How one chat request's choices are read; `plain` when the text is all content."""

    request_id: str  # tool call ids derive from it, so a stream and a whole answer agree
    reasoning: ReasoningParser | None = None
    tool_parser: ToolCallParser | None = None  # tool_choice "auto"
    tools: tuple[Tool, ...] = ()
    forced: ToolChoice | None = None  # "required" or a named function: the text is the grammar's JSON
    max_calls: int | None = None  # parallel_tool_calls false: 1 (vLLM's: later calls are dropped)
    include_reasoning: bool = True  # false: the reasoning is parsed out of the content and dropped

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tool_parser is None and self.forced is None

    def calls_parser(self) -> ToolCallParser | ForcedCalls | None:
        """What reads the calls in the text: the forced call's JSON, or --tool-call-parser's format."""
        return ForcedCalls(self.tools, self.forced) if self.forced is not None else self.tool_parser


def chat_message(text: str, finish_reason: str | None, out: ChatOutput) -> tuple[dict, str | None]:
    """(the choice's `message`, its finish_reason) for the choice's whole text."""
    reasoning = None
    if out.reasoning is not None:
        reasoning, text = out.reasoning.parse(text)
    calls: list[ToolCall] = []
    parser = out.calls_parser()
    if parser is not None:
        parsed = parser.parse(text)
        calls, content = parsed.calls, parsed.content
    else:
        content = text
    calls = calls[: out.max_calls]
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning is not None and out.include_reasoning:  # SGLang's and vLLM's older name, and vLLM's newer one
        message["reasoning_content"] = message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": call_id(out.request_id, i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(calls)
        ]
    return message, _finish(finish_reason, bool(calls))


class ChatDeltas:
    """One streamed choice's text deltas -> OpenAI chat delta objects."""

    def __init__(self, out: ChatOutput) -> None:
        self._out = out
        self._reasoning = out.reasoning.stream() if out.reasoning is not None else None
        parser = out.calls_parser()
        self._tools = parser.stream() if parser is not None else None
        self._made_calls = False

    def feed(self, text: str) -> list[dict]:
        if self._reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self._reasoning.feed(text)
        return self._with_reasoning(reasoning, self._content(content, final=False))

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas still held (a partial marker) and the finish_reason."""
        if self._reasoning is None:
            deltas = self._content("", final=True)
        else:
            reasoning, content = self._reasoning.finish()
            deltas = self._with_reasoning(reasoning, self._content(content, final=True))
        return deltas, _finish(finish_reason, self._made_calls)

    def _with_reasoning(self, reasoning: str, deltas: list[dict]) -> list[dict]:
        if not reasoning or not self._out.include_reasoning:
            return deltas
        return [{"reasoning_content": reasoning, "reasoning": reasoning}, *deltas]

    def _content(self, text: str, final: bool) -> list[dict]:
        if self._tools is None:
            return [{"content": text}] if text else []
        events = self._tools.finish() if final else []
        events = self._tools.feed(text) + events if text else events
        deltas: list[dict] = []
        for ev in events:
            if not isinstance(ev, ContentDelta) and self._out.max_calls is not None and ev.index >= self._out.max_calls:
                continue
            if isinstance(ev, ContentDelta):
                deltas.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                self._made_calls = True
                deltas.append({"tool_calls": [self._call_head(ev.index, ev.name)]})
            elif isinstance(ev, ArgumentsDelta):
                deltas.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
        return deltas

    def _call_head(self, index: int, name: str) -> dict:
        return {
            "index": index,
            "id": call_id(self._out.request_id, index),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }


def _finish(finish_reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason
