"""Batch incremental detokenizer, transport-free: one step() call per batch of token records.

Input columns (numpy): request index, token id, finish flag, for many requests, a request
possibly several times (in order). Output: per request, the new UTF-8 text (never a broken
character; nothing for requests whose tokens complete no character), whether it finished,
and which stop string it hit. Once a request finishes, the concatenation of its deltas is
`tokenizer.decode(ids, skip_special_tokens=...)` (cut at a stop string when one matched).

Two ways to turn ids into text:
- byte table (byte-level BPE, checked exact at start-up, see detok_vocab): a token is fixed
  bytes. Requests whose new tokens are all "plain" (valid UTF-8 on their own, not added
  tokens) and which hold nothing back take the vectorised path: their bytes are gathered
  with numpy, no Python per request. The rest (multi-byte characters split across tokens,
  special tokens, finishing, a token holding the first byte of one of the request's stop
  strings, held-back text) go through a per-request incremental UTF-8 decoder. Steps of a
  few tokens take that path whole (numpy's fixed cost per call is larger).
- window decode (any other tokenizer): SGLang's surrogate/read offsets. Each step decodes,
  in one batch_decode call for all requests, the ids from the last emitted token on and
  the ids already emitted; the difference is the delta, held back while it ends in U+FFFD
  (or, for SentencePiece byte fallback, in a run of byte tokens).

The text is decode()'s whatever the request's spaces_between_special_tokens: a fast
tokenizer's decode (every tokenizer of transformers 5) puts no space around added tokens
and ignores the flag, as SGLang's detokenizer and vLLM's fast one give it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import numpy as np

from protocol.vocab import REPLACEMENT, AddedTokens, NotByteExact, TokenTable, build_token_table, byte_fallback_ids
from runtime.detokenizer.stop_strings import StopMatcher


@dataclass(frozen=True)
class DetokOptions:
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    min_tokens: int = 0  # no stop string ends in the text of the first min_tokens tokens
    no_stop_trim: bool = False  # a matched stop string stays in the text (SGLang's no_stop_trim)


@dataclass(frozen=True)
class DetokOutput:
    """One step's results, one row per request with new text or a finish."""

    req: np.ndarray  # int64 [R]
    offset: np.ndarray  # int64 [R]: where the request's delta starts in text
    length: np.ndarray  # int64 [R]
    finished: np.ndarray  # bool [R]: finished this step (finish flag given, or a stop string hit)
    stop: np.ndarray  # int16 [R]: index of the matched stop string in DetokOptions.stop, -1 if none
    used: np.ndarray  # int64 [R]: at a stop string, the request's tokens of this step through the one
    #                       that completed it (the rest are not its); -1 otherwise
    text: np.ndarray  # uint8 [total]: every delta, back to back

    def delta(self, row: int) -> bytes:
        return self.text[self.offset[row] : self.offset[row] + self.length[row]].tobytes()


class _Request:
    """Per-request state for the Python path; the vectorised path touches none of it."""

    __slots__ = ("skip", "stop", "protect", "pending", "window", "read")

    def __init__(self, options: DetokOptions) -> None:
        self.skip = options.skip_special_tokens
        self.stop = StopMatcher(options.stop, options.no_stop_trim) if options.stop else None
        self.protect = options.min_tokens if options.stop else 0  # tokens left whose text ends no stop
        self.pending = b""  # byte-table path: bytes of a character not complete yet
        self.window: list[int] = []  # window path: ids from the last emitted token on
        self.read = 0  # window path: window[:read] is already emitted text


class BatchDetokenizer:
    def __init__(self, tokenizer, capacity: int, use_byte_table: bool = True, small_batch: int = 8) -> None:
        """capacity: request indices are [0, capacity). use_byte_table=False forces the
        window decode (for comparison); otherwise it is used only when the table is not exact.
        Steps of at most small_batch tokens take the Python path whole: numpy's fixed cost
        per call outweighs a few tokens of Python."""
        self.tokenizer = tokenizer
        self.small_batch = small_batch
        self.added = AddedTokens.of(tokenizer)
        self.vocab_size = len(tokenizer)
        self.table: TokenTable | None = None
        self.fallback_reason = "disabled" if not use_byte_table else ""
        if use_byte_table:
            try:
                self.table = build_token_table(tokenizer, self.added)
            except NotByteExact as e:
                self.fallback_reason = str(e)
        self._byte_run_ids = byte_fallback_ids(tokenizer) if self.table is None else frozenset()
        self._requests: list[_Request | None] = [None] * capacity
        self._live = np.zeros(capacity, bool)
        self._python = np.zeros(capacity, bool)  # must take the per-request path next step
        self._odd = ~self.table.plain if self.table is not None else None  # [V+1] token needs the Python path
        self._seen = np.zeros(capacity, np.int64)  # scratch: finds requests appearing twice in a step
        self._iota = np.arange(4096)  # 0, 1, 2, ... grown on demand
        self._no_finish = np.zeros(capacity, bool)
        self._no_stop = np.full(capacity, -1, np.int16)
        self._no_used = np.full(capacity, -1, np.int64)
        self._no_finish.flags.writeable = self._no_stop.flags.writeable = self._no_used.flags.writeable = False
        self._stop_first = np.zeros((capacity, 4), np.uint64)  # bitmap of the first bytes of each request's stops
        self._with_stop = 0  # open requests that have stop strings

    @property
    def capacity(self) -> int:
        return len(self._requests)

    def open(self, req: int, options: DetokOptions) -> None:
        """Starts (or restarts) request `req`; any state it had is dropped."""
        self.close(req)
        self._requests[req] = state = _Request(options)
        self._live[req] = True
        self._python[req] = self._needs_python(state)
        if state.stop is None:  # most requests: no numpy calls for the bitmap
            self._stop_first[req] = 0
            return
        first = np.zeros(256, bool)
        first[[s[0] for s in state.stop.stops]] = True
        self._stop_first[req] = np.packbits(first, bitorder="little").view(np.uint64)
        self._with_stop += 1

    def close(self, req: int) -> None:
        """Drops request `req` (aborted); its later tokens are ignored until open() again."""
        state = self._requests[req]
        if state is not None and state.stop is not None:
            self._with_stop -= 1
        self._requests[req] = None
        self._live[req] = False

    def step(self, req: np.ndarray, token: np.ndarray, finished: np.ndarray) -> DetokOutput:
        """req: int [N] in [0, capacity); token: int [N]; finished: bool [N]. A request may appear
        several times (its tokens in order). Token ids outside the vocabulary (e.g. -1) add no
        text, as decode() drops them. Tokens of requests not open (or finished) are ignored."""
        if len(req) <= self.small_batch:
            return self._per_request(self._group_small(req, token, finished))
        req = np.asarray(req, np.int64)
        token = np.asarray(token, np.int64)
        finished = np.asarray(finished, bool)
        live = self._live[req]
        if not live.all():
            req, token, finished = req[live], token[live], finished[live]
        n = len(req)
        if n == 0:
            return _EMPTY
        token = np.minimum(token.astype(np.uint64), self.vocab_size).astype(np.int64)  # -1 and too big -> vocab_size
        iota = self._arange(n)
        self._seen[req] = iota
        if (self._seen[req] != iota).any():
            # a request appears more than once: group its tokens, keeping their order
            order = np.argsort(req, kind="stable")
            req, token, finished = req[order], token[order], finished[order]
            head = np.empty(n, bool)
            head[0] = True
            np.not_equal(req[1:], req[:-1], out=head[1:])
            starts = np.flatnonzero(head)  # [G] first token of each request
        else:
            starts = None  # one token per request: groups are singletons
        reqs = req if starts is None else req[starts]  # [G]

        table, odd_tokens = self.table, self._odd  # both set, or neither
        if table is None or odd_tokens is None:
            slow = np.ones(len(reqs), bool)
        else:
            odd = odd_tokens[token] | finished
            if self._with_stop:  # a token holding the first byte of one of its request's stop strings
                odd |= (table.byte_bits[token] & self._stop_first[req]).any(axis=1)
            slow = (odd if starts is None else np.logical_or.reduceat(odd, starts)) | self._python[reqs]
        if starts is None:
            starts = iota
        ends = np.append(starts[1:], n)
        fast = self._gather(token, starts, ends, reqs, ~slow)
        if not slow.any():
            return fast
        tokens, finishes = token.tolist(), finished.tolist()
        groups = [
            (r, tokens[s:e], finishes[s:e])
            for r, s, e in zip(reqs[slow].tolist(), starts[slow].tolist(), ends[slow].tolist())
        ]
        return _concat(fast, self._per_request(groups))

    def _group_small(self, req, token, finished) -> list[tuple[int, list[int], list[bool]]]:
        groups: dict[int, tuple[int, list[int], list[bool]]] = {}
        vocab = self.vocab_size
        for r, t, f in zip(np.asarray(req).tolist(), np.asarray(token).tolist(), np.asarray(finished).tolist()):
            if self._requests[r] is not None:
                g = groups.get(r) or groups.setdefault(r, (r, [], []))
                g[1].append(t if 0 <= t < vocab else vocab)
                g[2].append(bool(f))
        return list(groups.values())

    def _gather(self, token, starts, ends, reqs, fast) -> DetokOutput:
        """The vectorised path: each fast request's delta is its tokens' bytes, joined."""
        table = self.table
        if table is None or not fast.any():  # no table: every request takes the Python path
            return _EMPTY
        sizes = (ends - starts)[fast]
        singles = len(token) == len(starts)
        tok = token[fast] if singles else token[np.repeat(fast, ends - starts)]  # [T] grouped by request
        lens = table.length[tok]  # [T]
        out_end = np.cumsum(lens)
        out_start = out_end - lens
        total = int(out_end[-1])
        text = table.blob[np.repeat(table.offset[tok] - out_start, lens) + self._arange(total)]
        if singles:
            length, start = lens, out_start
        else:
            first = np.cumsum(sizes) - sizes  # [F] first token of each fast request in tok
            length, start = np.add.reduceat(lens, first), out_start[first]
        reqs = reqs[fast]
        has = length > 0
        if not has.all():
            reqs, start, length = reqs[has], start[has], length[has]
        n = len(reqs)
        return DetokOutput(
            req=reqs,
            offset=start,
            length=length,
            finished=self._no_finish[:n],
            stop=self._no_stop[:n],
            used=self._no_used[:n],
            text=text,
        )

    def _arange(self, n: int) -> np.ndarray:
        if len(self._iota) < n:
            self._iota = np.arange(2 * n)
        return self._iota[:n]

    def _per_request(self, groups: list[tuple[int, list[int], list[bool]]]) -> DetokOutput:
        """The Python path: groups are (request, its tokens in order, their finish flags)."""
        if not groups:
            return _EMPTY
        merged: list[list] = []  # [request, text, finished, stop, tokens used]: a split group's parts joined
        for r, text, final, stop, n in self._decode_groups(self._rounds(groups)):
            if merged and merged[-1][0] == r:
                last = merged[-1]
                last[1] += text
                last[2], last[3], last[4] = final, stop, last[4] + n
            else:
                merged.append([r, text, final, stop, n])
        merged = [m for m in merged if m[1] or m[2]]
        length = np.array([len(m[1]) for m in merged], np.int64)
        return DetokOutput(
            req=np.array([m[0] for m in merged], np.int64),
            offset=np.cumsum(length) - length,
            length=length,
            finished=np.array([m[2] for m in merged], bool),
            stop=np.array([m[3] for m in merged], np.int16),
            used=np.array([m[4] if m[3] >= 0 else -1 for m in merged], np.int64),
            text=np.frombuffer(b"".join(m[1] for m in merged), np.uint8),
        )

    def _rounds(self, groups: list[tuple[int, list[int], list[bool]]]) -> list[list[tuple[int, list[int], list[bool]]]]:
        """Groups to decode in turn. A request with stop strings goes one token a round: a
        match is then known to end with that round's token (the tokens after it are not the
        request's: not its text, nor in its counts), and the tokens' text crosses its
        min_tokens (protected or not) one token at a time. The others go whole in the first."""
        rounds: list[list[tuple[int, list[int], list[bool]]]] = [[]]
        for r, tokens, finished in groups:
            req = self._requests[r]  # open: groups hold open requests only
            if req is None or req.stop is None or len(tokens) == 1:
                rounds[0].append((r, tokens, finished))
                continue
            for k in range(len(tokens)):
                if k == len(rounds):
                    rounds.append([])
                rounds[k].append((r, tokens[k : k + 1], finished[k : k + 1]))
        return rounds

    def _decode_groups(
        self, rounds: list[list[tuple[int, list[int], list[bool]]]]
    ) -> list[tuple[int, bytes, bool, int, int]]:
        """(request, text released, finished, stop index, tokens used) per group, a request's
        rows in order; a request that finished in a round takes no part in later ones."""
        rows = []
        for groups in rounds:
            jobs = []  # (req, state, text so far, final, protected, tokens used)
            for r, tokens, finished in groups:
                state = self._requests[r]
                if state is None:  # finished in an earlier round
                    continue
                final = True in finished
                if final:  # nothing after a request's finishing token belongs to it
                    tokens = tokens[: finished.index(True) + 1]
                protected = state.protect > 0
                state.protect = max(state.protect - len(tokens), 0)
                jobs.append((r, state, self._feed(state, tokens, final), final, protected, len(tokens)))
            if self.table is None:
                self._decode_windows(jobs)
            for r, state, parts, final, protected, n in jobs:
                text = "".join(parts).encode()
                stop = -1
                if state.stop is not None:
                    text, stop = state.stop.feed(text, final, protected)
                    final = final or stop >= 0
                if final:
                    self.close(r)
                else:
                    self._python[r] = self._needs_python(state)
                rows.append((r, text, final, stop, n))
        if len(rounds) > 1:  # a split group's rows side by side, in order (the sort is stable)
            rows.sort(key=lambda row: row[0])
        return rows

    def _feed(self, state: _Request, tokens: list[int], final: bool) -> list[str]:
        """Text of `tokens` as far as it is complete; the window path appends the ids to the
        request's window and leaves their text to _decode_windows."""
        parts: list[str] = []
        special = self.added.special if state.skip else ()
        run = [t for t in tokens if t != self.vocab_size and t not in special]  # decode() drops both
        if self.table is None:
            state.window += run
        else:
            parts.append(self._decode_utf8(self.table, state, run, final))
        return parts

    def _decode_utf8(self, table: TokenTable, state: _Request, run: list[int], final: bool) -> str:
        """Byte-table path: the run's bytes after what the request held back, decoded up to
        the last complete character (everything, with U+FFFD for the rest, when final)."""
        pieces = table.pieces
        data = state.pending + b"".join([pieces[t] for t in run])
        text, used = codecs.utf_8_decode(data, "replace", final)
        state.pending = data[used:]
        return text

    def _decode_windows(self, jobs) -> None:
        """Window path, all requests at once: delta = decode(window) minus decode(emitted part)."""
        windows = [(parts, state, final) for _, state, parts, final, _, _ in jobs if len(state.window) > state.read]
        if not windows:
            return
        texts = self.tokenizer.batch_decode(
            [s.window[: s.read] for _, s, _ in windows] + [s.window for _, s, _ in windows]
        )
        for (parts, state, final), surr, full in zip(windows, texts, texts[len(windows) :]):
            new = full[len(surr) :]
            if final or (new and not new.endswith(REPLACEMENT) and state.window[-1] not in self._byte_run_ids):
                parts.append(new)
                state.window = state.window[state.read :]
                state.read = len(state.window)

    def _needs_python(self, state: _Request) -> bool:
        """Whether the request's next tokens need the Python path whatever they are. A request
        with stop strings holding nothing back needs it only for tokens that contain the first
        byte of one of its stop strings (step checks that per token)."""
        return (
            self.table is None
            or bool(state.pending)
            or (state.stop is not None and (bool(state.stop.held) or state.protect > 0))
        )


def _concat(a: DetokOutput, b: DetokOutput) -> DetokOutput:
    if len(b.req) == 0:
        return a
    if len(a.req) == 0:
        return b
    return DetokOutput(
        req=np.concatenate([a.req, b.req]),
        offset=np.concatenate([a.offset, b.offset + len(a.text)]),
        length=np.concatenate([a.length, b.length]),
        finished=np.concatenate([a.finished, b.finished]),
        stop=np.concatenate([a.stop, b.stop]),
        used=np.concatenate([a.used, b.used]),
        text=np.concatenate([a.text, b.text]),
    )


_EMPTY = DetokOutput(
    req=np.zeros(0, np.int64),
    offset=np.zeros(0, np.int64),
    length=np.zeros(0, np.int64),
    finished=np.zeros(0, bool),
    stop=np.zeros(0, np.int16),
    used=np.zeros(0, np.int64),
    text=np.zeros(0, np.uint8),
)
