"""Stop strings over a stream of UTF-8 text deltas.

Text that could still be the start of a stop string is withheld until the next delta
shows it is not; on a match the text is cut where the stop string starts (the stop string
itself is not output, as OpenAI does), or where it ends when asked to keep it (SGLang's
no_stop_trim, vLLM's include_stop_str_in_output). Matching is on UTF-8 bytes: the text is valid UTF-8,
which is self-synchronising, so a byte match of a stop string is always a character match.

Text fed as `protected` (the text of a request's first min_tokens tokens) ends no match; a
match may start in it and end in later text, as vLLM matches (its detokenizer searches only
for stop strings that end in the text of tokens past min_tokens).
"""

from __future__ import annotations


class StopMatcher:
    """One request's stop strings and the text it is holding back."""

    __slots__ = ("stops", "keep", "held", "guard")

    def __init__(self, stops: tuple[str, ...], keep: bool = False) -> None:
        self.stops = tuple(s.encode() for s in stops)
        self.keep = keep  # a match's text is released with what came before it
        self.held = b""
        self.guard = 0  # held[:guard] is protected text: no match ends in it

    def feed(self, text: bytes, final: bool, protected: bool = False) -> tuple[bytes, int]:
        """-> (text to release now, index of the matched stop string or -1).

        Among several matches the one that ends first wins (it is the one a character-by-
        character stream would have hit first); among those, the longest."""
        buf = self.held + text
        guard = len(buf) if protected else self.guard  # a match must end past buf[:guard]
        best_end, best_start, best = len(buf) + 1, 0, -1
        for i, stop in enumerate(self.stops):
            start = buf.find(stop, max(guard - len(stop) + 1, 0))
            if start >= 0 and (start + len(stop), start) < (best_end, best_start):
                best_end, best_start, best = start + len(stop), start, i
        if best >= 0:
            self.held, self.guard = b"", 0
            return buf[: best_end if self.keep else best_start], best
        keep = 0 if final else self._partial_suffix(buf)
        self.held = buf[len(buf) - keep :]
        self.guard = max(guard - (len(buf) - keep), 0)
        return buf[: len(buf) - keep], -1

    def _partial_suffix(self, buf: bytes) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            # candidates start with the stop's first byte, within its last len(stop) - 1 bytes
            pos = buf.find(stop[:1], max(len(buf) - len(stop) + 1, 0))
            while pos >= 0 and len(buf) - pos > longest:
                if stop.startswith(buf[pos:]):
                    longest = len(buf) - pos
                    break
                pos = buf.find(stop[:1], pos + 1)
        return longest
