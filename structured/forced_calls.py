"""The calls in a forced call's output (tool_choice "required" or a named function), read as the
grammar's JSON arrives, so that a stream sends each call's name as soon as it is complete and
its arguments as they grow, as vLLM streams them.

The grammar (`structured.tools.forced_call_schema`) makes the text either the named function's
arguments object, or an array of `{"name": ..., "parameters": {...}}` objects. The reader
follows that JSON one character at a time: the structure (a stack of open containers, strings
and their escapes) is all it needs, because the grammar already guarantees the values. Whitespace
outside strings is dropped, so the arguments come out compact as the tool-call parsers write them
(strings and numbers are kept as the model wrote them).

`parse` is the stream fed the whole text at once, so whole and streamed answers agree, but for a
text cut short (max_tokens): the whole answer has the calls that were complete, as OpenAI answers
(a stream has sent the cut call's head and arguments so far; its finish_reason "length" says it
was cut). The JSON itself is never content."""

from __future__ import annotations

import json

from structured.tool_parsers import JSON_SPACE, ArgumentsDelta, CallStart, Event, ParsedCalls, ToolCall
from structured.tools import Tool, ToolChoice


class ForcedCalls:
    """A forced tool_choice's reader, with ToolCallParser's parse/stream."""

    def __init__(self, tools: tuple[Tool, ...], choice: ToolChoice) -> None:
        if choice.mode not in ("required", "function"):
            raise ValueError(f"tool_choice {choice.mode!r} forces no call")
        self.named = choice.name if choice.mode == "function" else None
        self.tool_names = frozenset(tool.name for tool in tools)

    def parse(self, text: str) -> ParsedCalls:
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        names = {e.index: e.name for e in events if isinstance(e, CallStart) and e.index in stream.complete}
        arguments = dict.fromkeys(names, "")
        for e in events:
            if isinstance(e, ArgumentsDelta) and e.index in names:
                arguments[e.index] += e.text
        return ParsedCalls("", [ToolCall(names[i], arguments[i]) for i in sorted(names)])

    def stream(self) -> ForcedCallStream:
        return ForcedCallStream(self)


class ForcedCallStream:
    """One choice's forced-call JSON, fed as it comes. The arguments region is the whole value
    (a named function) or each array item's "parameters" value ("required"); a call's region
    begins at its first character and ends where its container closes (or, for a scalar, at the
    next `,` or `}` of the call object)."""

    def __init__(self, forced: ForcedCalls) -> None:
        self.forced = forced
        self.stack: list[str] = []  # open containers: "{" or "["
        self.in_string = self.escaped = False
        self.expect_key = False  # in a call object: the next string is a key
        self.key: list[str] | None = None  # a call object's key being read
        self.member = ""  # the call object's member whose value comes next
        self.name: list[str] | None = None  # the "name" string being read
        self.index = -1  # the call being read
        self.names: dict[int, str] = {}  # calls whose name is known (and started)
        self.held: list[str] = []  # arguments read before the call's name
        self.args_depth: int | None = None  # stack depth where the arguments region began
        self.args_scalar = False
        self.done = False  # the named function's arguments closed: the rest is not a call
        self.complete: set[int] = set()  # calls whose arguments closed

    def feed(self, text: str) -> list[Event]:
        out: list[str] = []  # arguments characters for the current call
        events: list[Event] = []
        for ch in text:
            if self.done:
                break
            if self.in_string:
                self._string_char(ch, out, events)
                continue
            if ch in JSON_SPACE:
                continue
            if self.args_depth is None:
                self._maybe_open_args(ch, events)
            if self.args_depth is not None:
                if self.args_scalar and len(self.stack) == self.args_depth and ch in ",}":
                    self._close_args(out, events)  # the scalar ended; ch is the call object's own
                else:
                    out.append(ch)
            self._structure(ch, out, events)
        self._flush(out, events)
        return events

    def finish(self) -> list[Event]:
        return []

    # ---------------------------------------------------------------- one character

    def _maybe_open_args(self, ch: str, events: list[Event]) -> None:
        depth = len(self.stack)
        if self.forced.named is not None:
            opens = depth == 0 and self.index < 0
            if opens:  # the named function's call starts with its arguments
                self.index = 0
                self.names[0] = self.forced.named
                events.append(CallStart(0, self.forced.named))
        else:
            opens = depth == 2 and not self.expect_key and self.member == "parameters"
        if opens:
            self.args_depth, self.args_scalar = depth, ch not in "{["

    def _structure(self, ch: str, out: list[str], events: list[Event]) -> None:
        depth = len(self.stack)
        call_level = self.forced.named is None and depth == 2
        if ch == '"':
            self.in_string = True
            if call_level and self.args_depth is None:
                if self.expect_key:
                    self.key = []
                elif self.member == "name":
                    self.name = []
        elif ch in "{[":
            self.stack.append(ch)
            if self.forced.named is None and depth == 1 and ch == "{":  # a call object opens
                self._flush(out, events)
                self.index += 1
                self.held, self.expect_key, self.member = [], True, ""
        elif ch in "}]":
            if self.stack:
                self.stack.pop()
            if self.args_depth is not None and not self.args_scalar and len(self.stack) == self.args_depth:
                self._close_args(out, events)
        elif ch == ":" and call_level:
            self.expect_key = False
        elif ch == "," and call_level:
            self.expect_key, self.member = True, ""

    def _string_char(self, ch: str, out: list[str], events: list[Event]) -> None:
        if self.args_depth is not None:
            out.append(ch)
        elif self.key is not None or self.name is not None:
            (self.key if self.key is not None else self.name).append(ch)  # type: ignore[union-attr]
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            if self.key is not None:
                self.member, self.key = _decoded(self.key), None
            elif self.name is not None:
                name, self.name = _decoded(self.name), None
                if name in self.forced.tool_names and self.index not in self.names:
                    self._flush(out, events)
                    self.names[self.index] = name
                    events.append(CallStart(self.index, name))
                    out.extend(self.held)
                    self.held = []

    def _close_args(self, out: list[str], events: list[Event]) -> None:
        self._flush(out, events)
        self.complete.add(self.index)
        self.args_depth, self.args_scalar = None, False
        self.member = ""
        if self.forced.named is not None:
            self.done = True

    def _flush(self, out: list[str], events: list[Event]) -> None:
        """The arguments read so far go to their call, or are held until its name is known."""
        if not out:
            return
        text = "".join(out)
        out.clear()
        if self.index in self.names:
            events.append(ArgumentsDelta(self.index, text))
        else:
            self.held.append(text)


def _decoded(raw: list[str]) -> str:
    """A JSON string's text from its characters as written (with the closing quote)."""
    try:
        value = json.loads('"' + "".join(raw))
    except ValueError:
        return ""
    return value if isinstance(value, str) else ""
