"""Reasoning parsers, by SGLang's `--reasoning-parser` names: they split a model's text into the
reasoning it did between `<think>` and `</think>` and the content it answers with, whole or as a
stream of deltas.

Whitespace, as SGLang's non-streamed parse has it: the reasoning is stripped at both ends, and so
is the content after `</think>` (the model's "\\n\\n" after the tag is layout, not an answer). A
text with no reasoning section (qwen3 without a leading `<think>`) is content as it is, unstripped.
A stream's deltas add up to exactly what the whole parse gives, however the text is split: a
stream holds back whitespace and what may be the start of a tag until the next delta decides.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


class StripStream:
    """Streams a text's `.strip()`: leading whitespace is dropped and trailing whitespace held
    until something else follows it, so the pieces add up to the stripped whole."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept) :]
        return kept


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`: what a stream
    must hold back, as the next delta may complete the marker."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning format. `starts_in_reasoning`: the model's output begins inside its reasoning
    (its chat template opened `<think>` in the prompt, or the model omits it), so all text up to
    `</think>` is reasoning; otherwise only a text that starts with `<think>` has any."""

    starts_in_reasoning: bool

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content); reasoning is None when the text has no reasoning section."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        reasoning_tail, content_tail = stream.finish()
        return (reasoning + reasoning_tail if stream.has_reasoning else None), content + content_tail

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)


class ReasoningStream:
    """One response's text, fed as it is generated; each call returns the (reasoning, content)
    text it has decided."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._buffer = ""
        self._opening = True  # until we know whether the text opens with `<think>`
        self._in_reasoning = False
        self._after_reasoning = False
        self._reasoning = StripStream()
        self._content = StripStream()
        self.has_reasoning = False

    def feed(self, delta: str) -> tuple[str, str]:
        self._buffer += delta
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """The rest, held text included, once the model is done."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        if self._opening:
            head = self._buffer.lstrip()
            if head.startswith(THINK_START):
                self._buffer = head[len(THINK_START) :]
                self._in_reasoning = True
            elif THINK_START.startswith(head) and not final:
                return "", ""
            else:
                self._in_reasoning = self._starts_in_reasoning
            self._opening = False
            self.has_reasoning = self._in_reasoning
        if self._in_reasoning:
            end = self._buffer.find(THINK_END)
            if end < 0:
                held = 0 if final else partial_suffix(self._buffer, THINK_END)
                split = len(self._buffer) - held
                reasoning = self._reasoning.push(self._buffer[:split])
                self._buffer = self._buffer[split:]
                return reasoning, ""
            reasoning = self._reasoning.push(self._buffer[:end])
            self._buffer = self._buffer[end + len(THINK_END) :]
            self._in_reasoning = False
            self._after_reasoning = True
        content = self._content.push(self._buffer) if self._after_reasoning else self._buffer
        self._buffer = ""
        return reasoning, content


# SGLang's names; those that start in reasoning are its force_reasoning detectors
REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek-r1": ReasoningParser(starts_in_reasoning=True),
    "step3": ReasoningParser(starts_in_reasoning=True),
    "qwen3-thinking": ReasoningParser(starts_in_reasoning=True),
    "qwen3": ReasoningParser(starts_in_reasoning=False),
    "glm45": ReasoningParser(starts_in_reasoning=False),
}


def make_reasoning_parser(name: str) -> ReasoningParser:
    """The parser `--reasoning-parser NAME` asks for; ValueError names the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None
