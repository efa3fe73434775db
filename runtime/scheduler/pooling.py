"""Pooled requests (SamplingParams.pooling: embeddings, scores): prefill only, no token sampled;
what the runner is asked to read of a step's final hidden states for them, and the one POOLED
record that ends each.

A pooled request runs through the same admission, chunked prefill and KV pages as any other.
MEAN sums the final hidden states of every chunk (Req.pool_sum) and divides at the end; CLS
keeps the first chunk's first token; LAST and LABELS read the last chunk's last token. MEAN and
CLS need every prompt position computed, so they never take their KV from the prefix cache
(core.py _admit); LAST and LABELS do (items sharing a query share its pages). A prompt's last
token may run as a one-token decode (a chunk that left one token): it is pooled the same way.
Its pages go back as any finished request's: full ones to the radix cache, evictable at once.
"""

from __future__ import annotations

import math

import numpy as np

from gpu.forward_batch import POOL_FIRST, POOL_LABELS, POOL_LAST, POOL_SUM, PoolAsk
from protocol.record_bytes import concat_records
from protocol.records import NO_TOKEN, TOKEN_OUT, Finish, TokenKind
from protocol.sampling_params import Pooling
from runtime.scheduler.req import Req

NO_CACHE_POOLINGS = frozenset((Pooling.MEAN, Pooling.CLS))  # they read every prompt position's state
_NO_LABELS = np.zeros(0, np.int64)


class Pooler:
    """The running pooled requests, by table row, and this step's asks between ask() and records()."""

    def __init__(self, max_rows: int) -> None:
        self.pooled = np.zeros(max_rows, bool)  # by table row
        self.num_running = 0
        self._asked: list[tuple[Req, int]] = []  # (request, POOL_* kind) per PoolAsk entry, in order
        self._done: list[Req] = []  # requests whose last prompt token runs this step

    def admit(self, row: int, req: Req) -> None:
        if req.params.pooling:
            self.pooled[row] = True
            self.num_running += 1
            req.pool_sum = None  # a retracted request recomputes its prompt from the start (MEAN, CLS)

    def release(self, row: int) -> None:
        if self.pooled[row]:
            self.pooled[row] = False
            self.num_running -= 1

    def ask(
        self, reqs: list, rows: np.ndarray, starts: np.ndarray, q_lens: np.ndarray, sample: np.ndarray
    ) -> tuple[PoolAsk | None, np.ndarray]:
        """What the runner reads for the step's pooled sequences (rows, starts, q_lens, sample:
        the step's columns; reqs: the table's request by row), and `sample` with them taken out:
        a pooled request samples no token."""
        seqs = np.flatnonzero(self.pooled[rows])
        if not len(seqs):
            return None, sample
        sample = sample.copy()
        asked, kinds, labels = [], [], []
        for i in seqs.tolist():
            req: Req = reqs[int(rows[i])]
            pooling, last = req.params.pooling, bool(sample[i])
            kind = None
            if pooling == Pooling.MEAN:
                kind = POOL_SUM
            elif pooling == Pooling.CLS and starts[i] == 0:
                kind = POOL_FIRST
            elif pooling == Pooling.LAST and last:
                kind = POOL_LAST
            elif pooling == Pooling.LABELS and last:
                kind = POOL_LABELS
            if kind is not None:
                asked.append(i)
                kinds.append(kind)
                ids = np.asarray(req.params.allowed_token_ids, np.int64) if kind == POOL_LABELS else _NO_LABELS
                labels.append(ids)
                self._asked.append((req, kind))
            if last:
                self._done.append(req)
        sample[seqs] = False
        if not asked:
            return None, sample
        return PoolAsk(np.array(asked, np.int64), np.array(kinds, np.int64), tuple(labels)), sample

    def records(self, pooled: list[np.ndarray] | None) -> tuple[list[Req], np.ndarray | None, list[bytes]]:
        """After the forward: (the requests that end now, their POOLED records, each one's payload)."""
        asked, self._asked = self._asked, []
        done, self._done = self._done, []
        for (req, kind), vec in zip(asked, pooled or ()):
            if kind == POOL_SUM and req.pool_sum is not None:
                req.pool_sum += vec
            else:
                req.pool_sum = vec.astype(np.float32, copy=True)
        if not done:
            return [], None, []
        recs, payloads = [], []
        for req in done:
            value = req.pool_sum if req.pool_sum is not None else np.zeros(0, np.float32)
            if req.params.pooling == Pooling.MEAN:
                value = value / np.float32(len(req.prompt))
            payloads.append(np.ascontiguousarray(value, np.float32).tobytes())
            rec = np.zeros(1, TOKEN_OUT.dtype)
            rec["kind"], rec["worker"], rec["slot"], rec["gen"] = TokenKind.POOLED, req.worker, req.slot, req.generation
            rec["finish"], rec["token"], rec["logprob"] = Finish.STOP, NO_TOKEN, math.nan
            rec["prompt_tokens"], rec["cached_tokens"] = len(req.prompt), max(req.cached_tokens, 0)
            recs.append(rec)
            req.pool_sum = None
        return done, concat_records(recs), payloads
