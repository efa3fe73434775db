"""SGLang's stop_regex on the OpenAI routes: a choice stops where one of the request's patterns
matches its text. The HTTP worker's route coroutine checks each choice's new text before it takes
it (the reader and the detokenizer do no work for it); at a match the text is cut at the match's
end, the choice ends with finish_reason "stop" and the pattern as its matched_stop, and the
scheduler is told to stop generating it (TokenizerManager.stop_choice).

A pattern is searched in the choice's last TAIL_CHARS characters and each delta that arrived, as
SGLang searches a tail of the text after each token; a match that ends in the new delta counts.
"$" marks the end of the text seen so far, a delta (one record's tokens) at a time."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import regex

from protocol.records import Finish
from runtime.http_worker.req_state import ReqState

TAIL_CHARS = 256  # the text before a delta that a match may start in
SEARCH_TIMEOUT_S = 0.05  # a pattern that backtracks past this on one delta counts as not matching


class _Stopper(Protocol):
    def stop_choice(self, state: ReqState, matched: str) -> None: ...


class RegexStops:
    """One request's stop patterns and, per choice, the text they were searched in."""

    def __init__(self, patterns: Sequence[regex.Pattern], stopper: _Stopper, choices: int) -> None:
        self.patterns = patterns
        self.stopper = stopper
        self.tails = [""] * choices
        self.checked = [0] * choices  # parts of a choice's state.parts already searched

    def check(self, state: ReqState) -> None:
        """Searches the choice's parts that arrived since the last check, one at a time (a part is
        one record's delta: "$" is checked at each); at a match, cuts them at the match's end and
        ends the choice."""
        i = state.index
        if state.error is not None or state.finish == Finish.ABORT:
            return
        for k in range(self.checked[i], len(state.parts)):
            text = state.parts[k].decode(errors="replace")
            tail = self.tails[i]
            seen = tail + text
            end = self._match_end(seen, len(tail))
            if end is not None:
                del state.parts[k:]
                state.parts.append(text[: end[0] - len(tail)].encode())
                self.checked[i] = len(state.parts)
                self.stopper.stop_choice(state, end[1])
                return
            self.tails[i] = seen[-TAIL_CHARS:]
        self.checked[i] = len(state.parts)

    def _match_end(self, seen: str, after: int) -> tuple[int, str] | None:
        """(where the earliest-ending match ends, its pattern) among matches ending past `after`."""
        best: tuple[int, str] | None = None
        for pattern in self.patterns:
            try:
                for match in pattern.finditer(seen, timeout=SEARCH_TIMEOUT_S):
                    if match.end() > after:
                        if best is None or match.end() < best[0]:
                            best = (match.end(), pattern.pattern)
                        break
            except TimeoutError:
                continue
        return best

    def taken(self, state: ReqState) -> None:
        """The route took the choice's parts (a stream's delta): the next check starts afresh."""
        self.checked[state.index] = 0

    def around(self, render: Callable[[ReqState], bytes | None]) -> Callable[[ReqState], bytes | None]:
        """A stream's render that checks each choice's new text first."""

        def checked(state: ReqState) -> bytes | None:
            self.check(state)
            try:
                return render(state)
            finally:
                self.taken(state)

        return checked
