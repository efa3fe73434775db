"""Tool-call parsers, by SGLang's `--tool-call-parser` names: they find the calls a model wrote
in its text, whole (`parse`) or as a stream of deltas (`stream`).

One state machine does both: `parse(text)` is a stream fed the whole text at once, and a stream
decides nothing that a later delta could change (it holds back what may be the start of a
marker, and a call until its block is complete and valid). So a stream's content deltas add up to
the whole parse's content, and each call's argument deltas to its arguments, however the text is
split. A call is emitted whole, once its block has closed: a call streamed as it grows could not
be taken back when its JSON turned out malformed or its tool unknown.

Rules shared by every format:
- a call is `{"name": <one of the request's tools>, "arguments" (or "parameters"): <object>}`;
  arguments given as a string holding a JSON object are taken as that object, absent as `{}`;
- a block that does not hold such calls (malformed JSON, an unknown name, text cut short inside
  the JSON) stays in the content as the text it was: nothing the model wrote is dropped;
- arguments are normalized to compact JSON (no whitespace outside strings, non-ASCII kept),
  as `json.dumps(separators=(",", ":"), ensure_ascii=False)` writes them;
- content is the text outside calls, joined and stripped at both ends (SGLang strips the text
  before the first call; the text after calls is kept here too, as a stream sends it).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from structured.reasoning import StripStream, partial_suffix

JSON_SPACE = " \t\r\n"
NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")  # OpenAI's tool names
MAX_NAME_CHARS = 64
MAX_JSON_DEPTH = 128  # deeper blocks are content: json.loads recurses, and no tool call nests so deep


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as compact JSON text


@dataclass(frozen=True)
class ParsedCalls:
    content: str
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str


Event = ContentDelta | CallStart | ArgumentsDelta


def call_id(request_id: str, index: int) -> str:
    """The id of a response's index-th call: derived, not random, so the streamed and the
    whole answer to one request name their calls alike."""
    digest = hashlib.blake2b(f"{request_id}\0{index}".encode(), digest_size=12).hexdigest()
    return "call_" + digest


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: json.dumps would write Infinity, which is not JSON
        raise ValueError(f"number out of range: {text}")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def loads_json(text: str) -> object:
    """Strict JSON (no NaN or Infinity); stdlib rather than orjson, which turns integers past
    64 bits into floats. Raises ValueError, for nesting too deep to decode too."""
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def compact_json(value: object) -> str:
    """The one normalization of arguments, for whole parses, streams and forced calls alike.
    Raises ValueError for a string no UTF-8 can carry (a lone surrogate from a \\ud800 escape)."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        text.encode()
    except UnicodeEncodeError as e:
        raise ValueError("unpaired surrogate in JSON string") from e
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    return text


def call_from_json(value: object, tool_names: frozenset[str]) -> ToolCall | None:
    """The call a decoded JSON object stands for, or None when it is not a call of a known tool."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or name not in tool_names or ("arguments" in value and "parameters" in value):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = loads_json(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return ToolCall(name, compact_json(arguments))
    except ValueError:
        return None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in JSON_SPACE:
        pos += 1
    return pos


# What a format's block step decides, besides an index: wait for more text, or give the block up
# as content.
NEED_MORE = -1
REJECT = -2


class _JsonExtent:
    """Where a JSON object or array that opens at `start` closes, scanned as the text grows
    (brackets in strings do not count); whether it is valid JSON is for json.loads to say."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._closers: list[str] = []
        self._in_string = False
        self._escaped = False
        self._end = NEED_MORE  # until decided: then an index or REJECT

    def end(self, text: str) -> int:
        """The index just past the closing bracket; NEED_MORE while open; REJECT when the
        brackets cannot match (or nest too deep)."""
        pos = self._pos
        while self._end == NEED_MORE and pos < len(text):
            char = text[pos]
            pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char == "{" or char == "[":
                self._closers.append("}" if char == "{" else "]")
                if len(self._closers) > MAX_JSON_DEPTH:
                    self._end = REJECT
            elif char == "}" or char == "]":
                if not self._closers or self._closers.pop() != char:
                    self._end = REJECT
                elif not self._closers:
                    self._end = pos
        self._pos = pos
        return self._end


@dataclass(frozen=True)
class Accept:
    calls: list[ToolCall]
    consumed: int


Outcome = Accept | int  # NEED_MORE or REJECT


class ToolCallParser:
    """A tool-call format, for one request's tools. A format opens a block at `marker` (the
    block's text starts with it); `_block` decides what the block holds."""

    marker: ClassVar[str]
    chains_calls: ClassVar[bool] = False  # after a call the block goes on (llama3's `;`)

    def __init__(self, tool_names: Iterable[str]) -> None:
        self.tool_names = frozenset(tool_names)

    def parse(self, text: str) -> ParsedCalls:
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        names = {e.index: e.name for e in events if isinstance(e, CallStart)}
        arguments = {i: "" for i in names}
        for e in events:
            if isinstance(e, ArgumentsDelta):
                arguments[e.index] += e.text
        return ParsedCalls(content, [ToolCall(names[i], arguments[i]) for i in sorted(names)])

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def _opening(self, text: str, at_start: bool) -> tuple[int, int] | None:
        """(where the first block in `text` opens, the length of its marker), or None."""
        pos = text.find(self.marker)
        return None if pos < 0 else (pos, len(self.marker))

    def _undecided_tail(self, text: str, at_start: bool) -> int:
        """How many of the last characters of `text` (which holds no opening) may yet become one."""
        return partial_suffix(text, self.marker)

    def _block(self, text: str, marker_len: int, calls_before: int, stream: ToolCallStream, final: bool) -> Outcome:
        raise NotImplementedError

    def _call(self, text: str) -> ToolCall | None:
        try:
            return call_from_json(loads_json(text), self.tool_names)
        except ValueError:
            return None


def _json_at(text: str, pos: int, openers: str, stream: ToolCallStream, final: bool) -> int:
    """The end of the JSON object or array that opens at `pos`, NEED_MORE or REJECT: as
    `_JsonExtent.end`, but when the text is final an unclosed bracket is REJECT."""
    if pos == len(text):
        return REJECT if final else NEED_MORE
    if text[pos] not in openers:
        return REJECT
    end = stream.extent(pos).end(text)
    return REJECT if end == NEED_MORE and final else end


def _closed_by(text: str, pos: int, closer: str, final: bool) -> int:
    """The index past `closer` when it follows `pos` (after whitespace), NEED_MORE or REJECT.
    A text that ends instead counts as closed: a model stopped right after the call's JSON
    (by a stop string, or max_tokens) still made the call."""
    pos = _skip_space(text, pos)
    if text.startswith(closer, pos):
        return pos + len(closer)
    if not final and closer.startswith(text[pos:]):
        return NEED_MORE
    return len(text) if pos == len(text) else REJECT


class HermesParser(ToolCallParser):
    """Hermes and Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
    block per call, text before and between them."""

    marker = "<tool_call>"
    closer = "</tool_call>"

    def _block(self, text: str, marker_len: int, calls_before: int, stream: ToolCallStream, final: bool) -> Outcome:
        start = _skip_space(text, marker_len)
        end = _json_at(text, start, "{", stream, final)
        if end < 0:
            return end
        call = self._call(text[start:end])
        if call is None:
            return REJECT
        consumed = _closed_by(text, end, self.closer, final)
        if consumed < 0:
            return consumed
        return Accept([call], consumed)


class MistralParser(ToolCallParser):
    """Mistral, after the content: before tokenizer v11, `[TOOL_CALLS] [{"name": ..., "arguments":
    {...}}, ...]` (or a single object), all the array's calls taken or none; from v11 on (Mistral
    Small 3.1+, Devstral, Magistral), `[TOOL_CALLS]name[ARGS]{...}` per call, `[ARGS]` missing
    when special tokens were skipped in detokenizing."""

    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def _block(self, text: str, marker_len: int, calls_before: int, stream: ToolCallStream, final: bool) -> Outcome:
        start = _skip_space(text, marker_len)
        if start < len(text) and text[start] not in "[{":
            return self._named_call(text, start, stream, final)
        end = _json_at(text, start, "[{", stream, final)
        if end < 0:
            return end
        try:
            value = loads_json(text[start:end])
        except ValueError:
            return REJECT
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(item, self.tool_names) for item in items]
        valid = [call for call in calls if call is not None]
        if not calls or len(valid) < len(calls):
            return REJECT
        return Accept(valid, end)

    def _named_call(self, text: str, start: int, stream: ToolCallStream, final: bool) -> Outcome:
        name_end = start
        while name_end < len(text) and name_end - start <= MAX_NAME_CHARS and text[name_end] in NAME_CHARS:
            name_end += 1
        if name_end == start or name_end - start > MAX_NAME_CHARS:
            return REJECT
        if name_end == len(text):
            return REJECT if final else NEED_MORE
        args_start = name_end
        if text.startswith(self.args_marker, args_start):
            args_start += len(self.args_marker)
        elif not final and self.args_marker.startswith(text[args_start:]):
            return NEED_MORE
        end = _json_at(text, args_start, "{", stream, final)
        if end < 0:
            return end
        try:
            arguments = loads_json(text[args_start:end])
        except ValueError:
            return REJECT
        call = call_from_json({"name": text[start:name_end], "arguments": arguments}, self.tool_names)
        return REJECT if call is None else Accept([call], end)


class Llama3Parser(ToolCallParser):
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole answer, or
    after `<|python_tag|>`, several joined by `;`. Without the tag, only a text that begins with
    `{` holds calls; after the last call that parses, the rest is content."""

    marker = "<|python_tag|>"
    chains_calls = True

    def _opening(self, text: str, at_start: bool) -> tuple[int, int] | None:
        if at_start:
            head = _skip_space(text, 0)
            if text.startswith("{", head):
                return head, 0
        return super()._opening(text, at_start)

    def _undecided_tail(self, text: str, at_start: bool) -> int:
        if at_start and _skip_space(text, 0) == len(text):
            return len(text)  # only whitespace yet: a `{` may still open the answer
        return super()._undecided_tail(text, at_start)

    def _block(self, text: str, marker_len: int, calls_before: int, stream: ToolCallStream, final: bool) -> Outcome:
        start = _skip_space(text, marker_len)
        if calls_before:
            if start == len(text):
                return REJECT if final else NEED_MORE
            if text[start] != ";":
                return REJECT
            start = _skip_space(text, start + 1)
        end = _json_at(text, start, "{", stream, final)
        if end < 0:
            return end
        call = self._call(text[start:end])
        return REJECT if call is None else Accept([call], end)


class ToolCallStream:
    """One response's text, fed as it is generated; `feed` and `finish` return the events it
    has decided."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._buffer = ""  # undecided text; in a block, it starts at the block's marker
        self._at_start = True  # nothing decided yet (llama3 reads a leading `{` as a call)
        self._in_block = False
        self._marker_len = 0
        self._block_calls = 0
        self._extent: _JsonExtent | None = None
        self._calls = 0
        self._content = StripStream()

    def feed(self, delta: str) -> list[Event]:
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """The rest, held text included, once the model is done."""
        return self._drain(final=True)

    def extent(self, start: int) -> _JsonExtent:
        """The scan of the JSON value opening at `start` in the buffer, kept across deltas so a
        long call is scanned once."""
        if self._extent is None or self._extent.start != start:
            self._extent = _JsonExtent(start)
        return self._extent

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._block_step(events, final) if self._in_block else self._content_step(events, final):
            pass
        return events

    def _emit_content(self, events: list[Event], text: str) -> None:
        text = self._content.push(text)
        if text:
            events.append(ContentDelta(text))

    def _consume(self, size: int) -> None:
        self._buffer = self._buffer[size:]
        self._extent = None

    def _content_step(self, events: list[Event], final: bool) -> bool:
        """Emits the content before the next block and enters it; False when nothing is left to do."""
        opening = self._parser._opening(self._buffer, self._at_start)
        if opening is None:
            held = 0 if final else self._parser._undecided_tail(self._buffer, self._at_start)
            decided = len(self._buffer) - held
            if self._buffer[:decided].strip(JSON_SPACE):
                self._at_start = False
            self._emit_content(events, self._buffer[:decided])
            self._consume(decided)
            return False
        pos, self._marker_len = opening
        self._emit_content(events, self._buffer[:pos])
        self._consume(pos)
        self._at_start = False
        self._in_block = True
        self._block_calls = 0
        return True

    def _block_step(self, events: list[Event], final: bool) -> bool:
        """Decides the block's next calls, or that it is content; False while undecided."""
        outcome = self._parser._block(self._buffer, self._marker_len, self._block_calls, self, final)
        if outcome == NEED_MORE:
            return False
        if isinstance(outcome, Accept):
            for call in outcome.calls:
                events += [CallStart(self._calls, call.name), ArgumentsDelta(self._calls, call.arguments)]
                self._calls += 1
            self._block_calls += len(outcome.calls)
            self._marker_len = 0
            self._consume(outcome.consumed)
            self._in_block = self._parser.chains_calls
            return True
        if not self._block_calls:  # the marker was not one: it is text, and so is what follows
            self._emit_content(events, self._buffer[: self._marker_len])
            self._consume(self._marker_len)
        self._in_block = False
        return True


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}


def make_parser(name: str, tool_names: Iterable[str]) -> ToolCallParser:
    """The parser `--tool-call-parser NAME` asks for, for one request's tools; ValueError names
    the known ones."""
    try:
        parser_class = PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
    return parser_class(tool_names)


# what a chat template writes when it renders an assistant's tool calls, and the parser that
# reads such calls back: the default of --tool-call-parser
TEMPLATE_CALL_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3"))


def template_tool_call_parser(chat_template: str | None) -> str | None:
    """The parser of the tool-call format `chat_template` renders, or None when it shows none."""
    for marker, name in TEMPLATE_CALL_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None
