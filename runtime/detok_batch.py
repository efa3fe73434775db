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
  special tokens, finishing, stop strings) go through a per-request incremental UTF-8 decoder.
- window decode (any other tokenizer): SGLang's surrogate/read offsets. Each step decodes,
  in one batch_decode call for all requests, the ids from the last emitted token on and
  the ids already emitted; the difference is the delta, held back while it ends in U+FFFD
  (or, for SentencePiece byte fallback, in a run of byte tokens).

spaces_between_special_tokens, when special tokens are kept, puts one space between each
added token and the text around it (vLLM / slow-tokenizer semantics: " ".join of the runs
of ordinary tokens and the added tokens); fast tokenizers' decode() ignores the flag, so
the output equals decode() exactly when the flag is off or when no added token is kept.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass

import numpy as np

from runtime.detok_stop import StopMatcher
from runtime.detok_vocab import (REPLACEMENT, AddedTokens, NotByteExact, TokenTable, build_token_table,
                                 byte_fallback_ids)

_utf8_decoder = codecs.getincrementaldecoder("utf-8")


@dataclass(frozen=True)
class DetokOptions:
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class DetokOutput:
    """One step's results, one row per request with new text or a finish."""
    req: np.ndarray       # int64 [R]
    offset: np.ndarray    # int64 [R]: where the request's delta starts in text
    length: np.ndarray    # int64 [R]
    finished: np.ndarray  # bool [R]: finished this step (finish flag given, or a stop string hit)
    stop: np.ndarray      # int16 [R]: index of the matched stop string in DetokOptions.stop, -1 if none
    text: np.ndarray      # uint8 [total]: every delta, back to back

    def delta(self, row: int) -> bytes:
        return self.text[self.offset[row]: self.offset[row] + self.length[row]].tobytes()


class _Request:
    """Per-request state for the Python path; the vectorised path touches none of it."""
    __slots__ = ("skip", "spaces", "stop", "utf8", "window", "read", "has_text", "in_run")

    def __init__(self, options: DetokOptions) -> None:
        self.skip = options.skip_special_tokens
        self.spaces = options.spaces_between_special_tokens
        self.stop = StopMatcher(options.stop) if options.stop else None
        self.utf8 = _utf8_decoder("replace")  # byte-table path: holds an incomplete character
        self.window: list[int] = []  # window path: ids from the last emitted token on
        self.read = 0                # window path: window[:read] is already emitted text
        self.has_text = False        # spaces mode: a run or an added token came before
        self.in_run = False          # spaces mode: the last kept token was an ordinary one


class BatchDetokenizer:
    def __init__(self, tokenizer, capacity: int, use_byte_table: bool = True) -> None:
        """capacity: request indices are [0, capacity). use_byte_table=False forces the
        window decode (for comparison); otherwise it is used only when the table is not exact."""
        self.tokenizer = tokenizer
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
        self._live = np.zeros(capacity + 1, bool)  # last entry: never live, for out-of-range indices
        self._python = np.zeros(capacity, bool)    # must take the per-request path next step

    @property
    def capacity(self) -> int:
        return len(self._requests)

    def open(self, req: int, options: DetokOptions) -> None:
        """Starts (or restarts) request `req`; any state it had is dropped."""
        self._requests[req] = state = _Request(options)
        self._live[req] = True
        self._python[req] = self._needs_python(state)

    def close(self, req: int) -> None:
        """Drops request `req` (aborted); its later tokens are ignored until open() again."""
        self._requests[req] = None
        self._live[req] = False

    def step(self, req: np.ndarray, token: np.ndarray, finished: np.ndarray) -> DetokOutput:
        """req, token: int [N]; finished: bool [N]. Token ids outside the vocabulary (e.g. -1)
        add no text, as decode() drops them. Tokens of requests not open (or already finished) are ignored."""
        req = np.asarray(req, np.int64)
        req = np.where((req < 0) | (req >= self.capacity), self.capacity, req)
        live = self._live[req]
        token = np.asarray(token, np.int64)
        finished = np.asarray(finished, bool)
        if not live.all():
            req, token, finished = req[live], token[live], finished[live]
        if len(req) == 0:
            return _EMPTY
        order = np.argsort(req, kind="stable")  # group each request's tokens, keeping their order
        req, token, finished = req[order], token[order], finished[order]
        head = np.empty(len(req), bool)
        head[0] = True
        np.not_equal(req[1:], req[:-1], out=head[1:])
        starts = np.flatnonzero(head)             # [G] first token of each request
        ends = np.append(starts[1:], len(req))    # [G]
        reqs = req[starts]                        # [G]

        token = np.where((token < 0) | (token >= self.vocab_size), self.vocab_size, token)
        if self.table is None:
            slow = np.ones(len(starts), bool)
        else:
            odd = ~self.table.plain[token] | finished
            slow = np.logical_or.reduceat(odd, starts) | self._python[reqs]
        fast = self._gather(token, starts, ends, reqs, ~slow)
        rest = self._per_request(token, finished, starts[slow], ends[slow], reqs[slow])
        return _concat(fast, rest)

    def _gather(self, token, starts, ends, reqs, fast) -> DetokOutput:
        """The vectorised path: each fast request's delta is its tokens' bytes, joined."""
        if not fast.any():
            return _EMPTY
        sizes = (ends - starts)[fast]
        tok = token[np.repeat(fast, ends - starts)]   # [T] tokens of fast requests, grouped
        lens = self.table.length[tok]                 # [T]
        out_end = np.cumsum(lens)
        out_start = out_end - lens
        total = int(out_end[-1])
        src = np.repeat(self.table.offset[tok] - out_start, lens) + np.arange(total)
        text = self.table.blob[src]
        first = np.cumsum(sizes) - sizes              # [F] first token of each fast request in tok
        length = np.add.reduceat(lens, first)
        has = length > 0
        n = int(has.sum())
        return DetokOutput(req=reqs[fast][has], offset=out_start[first][has], length=length[has],
                           finished=np.zeros(n, bool), stop=np.full(n, -1, np.int16), text=text)

    def _per_request(self, token, finished, starts, ends, reqs) -> DetokOutput:
        if len(reqs) == 0:
            return _EMPTY
        token, finished = token.tolist(), finished.tolist()
        jobs = []  # (req, state, text so far, final)
        for r, s, e in zip(reqs.tolist(), starts.tolist(), ends.tolist()):
            final = any(finished[s:e])
            if final:  # nothing after a request's finishing token belongs to it
                e = s + finished[s:e].index(True) + 1
            state = self._requests[r]
            jobs.append((r, state, self._feed(state, token[s:e], final), final))
        if self.table is None:
            self._decode_windows(jobs)

        out_req, out_len, out_fin, out_stop, chunks = [], [], [], [], []
        for r, state, parts, final in jobs:
            text = "".join(parts).encode()
            stop = -1
            if state.stop is not None:
                text, stop = state.stop.feed(text, final)
                final = final or stop >= 0
            if final:
                self.close(r)
            else:
                self._python[r] = self._needs_python(state)
            if text or final:
                out_req.append(r)
                out_len.append(len(text))
                out_fin.append(final)
                out_stop.append(stop)
                chunks.append(text)
        length = np.array(out_len, np.int64)
        return DetokOutput(req=np.array(out_req, np.int64), offset=np.cumsum(length) - length,
                           length=length, finished=np.array(out_fin, bool),
                           stop=np.array(out_stop, np.int16),
                           text=np.frombuffer(b"".join(chunks), np.uint8))

    def _feed(self, state: _Request, tokens: list[int], final: bool) -> list[str]:
        """Text of `tokens` as far as it is complete; the window path appends its ids to the
        window and leaves their text to _decode_windows."""
        parts: list[str] = []
        added = self.added.text
        table = self.table
        for t in tokens:
            if t in added:
                if state.skip and t in self.added.special:
                    continue
                if state.spaces:
                    parts.append(self._flush_run(state))
                    if state.has_text:
                        parts.append(" ")
                    parts.append(added[t])
                    state.has_text, state.in_run = True, False
                    continue
            elif t == self.vocab_size:
                continue  # no token: decode() drops ids outside the vocabulary
            if state.spaces and not state.in_run:
                if state.has_text:
                    parts.append(" ")
                state.has_text = state.in_run = True
            if table is None:
                state.window.append(t)
            else:
                parts.append(state.utf8.decode(table.pieces[t]))
        if final and table is not None:
            parts.append(state.utf8.decode(b"", True))
        return parts

    def _flush_run(self, state: _Request) -> str:
        """Ends the current run of ordinary tokens (spaces mode decodes each run on its own)."""
        if self.table is not None:
            return state.utf8.decode(b"", True)
        if not state.window:
            return ""
        surr, full = self.tokenizer.batch_decode([state.window[: state.read], state.window])
        state.window, state.read = [], 0
        return full[len(surr):]

    def _decode_windows(self, jobs) -> None:
        """Window path, all requests at once: delta = decode(window) minus decode(emitted part)."""
        windows = [(parts, state, final) for _, state, parts, final in jobs if len(state.window) > state.read]
        if not windows:
            return
        texts = self.tokenizer.batch_decode([s.window[: s.read] for _, s, _ in windows]
                                            + [s.window for _, s, _ in windows])
        for (parts, state, final), surr, full in zip(windows, texts, texts[len(windows):]):
            new = full[len(surr):]
            if final or (new and not new.endswith(REPLACEMENT) and state.window[-1] not in self._byte_run_ids):
                parts.append(new)
                state.window = state.window[state.read:]
                state.read = len(state.window)

    def _needs_python(self, state: _Request) -> bool:
        return (self.table is None or state.stop is not None or bool(state.utf8.getstate()[0])
                or (state.spaces and not state.in_run))


def _concat(a: DetokOutput, b: DetokOutput) -> DetokOutput:
    if len(b.req) == 0:
        return a
    if len(a.req) == 0:
        return b
    return DetokOutput(req=np.concatenate([a.req, b.req]),
                       offset=np.concatenate([a.offset, b.offset + len(a.text)]),
                       length=np.concatenate([a.length, b.length]),
                       finished=np.concatenate([a.finished, b.finished]),
                       stop=np.concatenate([a.stop, b.stop]),
                       text=np.concatenate([a.text, b.text]))


_EMPTY = DetokOutput(req=np.zeros(0, np.int64), offset=np.zeros(0, np.int64), length=np.zeros(0, np.int64),
                     finished=np.zeros(0, bool), stop=np.zeros(0, np.int16), text=np.zeros(0, np.uint8))
