"""Per-row state of the running requests as numpy arrays, so that a step's bookkeeping
(page needs, token append, finish checks, token-out records) is a few calls over the batch
instead of a Python loop over requests (SGLang's req_to_token pool).

A row is held from admission to finish/abort/retraction and is the same row index the
model runner keeps its per-request sampler state in.

The per-step methods (decode_rows, add_pages, step_input, append, reserved_tokens) run in C
(gpu/kvcache/step_core.c: one call each, where numpy needs dozens of calls a step, each with
a fixed cost whatever the batch) or, where it cannot be built, as the numpy below: same results
(tests run both).

A request is known here only as a RowOwner (what admission reads from it), so that the KV
cache imports nothing from the scheduler that drives it.
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import numpy as np

from cbuild import BuildError, build_extension
from gpu.kvcache.ngram import ngram_draft
from protocol.record_bytes import take_records
from protocol.records import TOKEN_OUT, Finish, fields_of
from protocol.sampling_params import SamplingParams

MAX_STOP_IDS = 32  # eos ids + stop_token_ids per request
_LENGTH, _STOP = np.uint8(Finish.LENGTH), np.uint8(Finish.STOP)
_SOURCE = Path(__file__).with_name("step_core.c")


@lru_cache(maxsize=1)
def step_core() -> type | None:
    """The StepCore type, or None where the numpy path is used."""
    try:
        return build_extension("gpu.kvcache.step_core", _SOURCE, subdir="kvcache").StepCore
    except (BuildError, ImportError, OSError) as e:
        warnings.warn(
            f"scheduler: the C step bookkeeping is unavailable ({e}); numpy does it", RuntimeWarning, stacklevel=2
        )
        return None


def _c(a: np.ndarray, dtype: type) -> np.ndarray:
    """`a` as the C-contiguous array of `dtype` step_core takes (itself when it is one already)."""
    return np.ascontiguousarray(a, dtype)


class RowOwner(Protocol):
    """What the table reads from a request it admits, and the row it gives it (-1 once released)."""

    worker: int
    slot: int
    generation: int
    prompt: np.ndarray  # int32 [P]
    params: SamplingParams
    arrival: int
    cached_tokens: int
    row: int


R = TypeVar("R", bound=RowOwner)


class ReqTable(Generic[R]):
    def __init__(self, num_rows: int, max_seq_len: int, page_size: int, native: bool = True) -> None:
        self.num_rows = num_rows
        self.max_seq_len = max_seq_len
        self.page_size = page_size
        max_pages = -(-max_seq_len // page_size)
        self.ids = np.zeros((num_rows, max_seq_len), dtype=np.int32)  # prompt + output tokens
        self.page_table = np.zeros((num_rows, max_pages), dtype=np.int32)
        self.length = np.zeros(num_rows, dtype=np.int32)  # tokens known (prompt + output)
        self.kv_len = np.zeros(num_rows, dtype=np.int32)  # tokens whose KV is in the cache
        self.num_pages = np.zeros(num_rows, dtype=np.int32)
        self.prompt_len = np.zeros(num_rows, dtype=np.int32)
        self.max_len = np.zeros(num_rows, dtype=np.int32)  # finish with "length" when reached
        self.min_len = np.zeros(num_rows, dtype=np.int32)  # stop tokens count only past this
        self.stop_ids = np.full((num_rows, MAX_STOP_IDS), -1, dtype=np.int32)
        self.arrival = np.zeros(num_rows, dtype=np.int64)
        # each row's token-out record with what stays fixed while it runs (address, prompt and
        # cached tokens): a step's records start as one gather of these
        self.events = np.zeros(num_rows, dtype=TOKEN_OUT.dtype)
        self.active = np.zeros(num_rows, dtype=bool)
        self.reqs: list[R | None] = [None] * num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.ones = np.ones(num_rows, np.int64)  # decodes' q_lens: a slice (shared, so read-only)
        self.ones.flags.writeable = False
        core = step_core() if native else None
        f = fields_of(TOKEN_OUT.dtype)
        self._core = (
            None
            if core is None
            else core(
                self.ids,
                self.page_table,
                self.length,
                self.kv_len,
                self.num_pages,
                self.prompt_len,
                self.max_len,
                self.min_len,
                self.stop_ids,
                self.active,
                self.events,
                (
                    TOKEN_OUT.dtype.itemsize,
                    f["token"][1],
                    f["logprob"][1],
                    f["finish"][1],
                    f["completion_tokens"][1],
                    int(_LENGTH),
                    int(_STOP),
                ),
            )
        )

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_active(self) -> int:
        return self.num_rows - len(self._free_rows)

    def admit(self, req: R, fill: np.ndarray, max_len: int, stop_ids: np.ndarray) -> int:
        """Takes a free row for `req`, whose known tokens are `fill`; returns the row."""
        row = self._free_rows.pop()
        n, p = len(fill), len(req.prompt)
        self.ids[row, :n] = fill
        self.length[row] = n
        self.kv_len[row] = 0
        self.num_pages[row] = 0
        self.prompt_len[row] = p
        self.max_len[row] = max_len
        self.min_len[row] = p + req.params.min_new_tokens
        self.stop_ids[row] = -1
        self.stop_ids[row, : len(stop_ids)] = stop_ids
        self.arrival[row] = req.arrival
        ev = self.events[row : row + 1]
        ev["worker"], ev["slot"], ev["gen"] = req.worker, req.slot, req.generation
        ev["prompt_tokens"], ev["cached_tokens"] = p, max(req.cached_tokens, 0)
        self.active[row] = True
        self.reqs[row] = req
        req.row = row
        return row

    def held(self, row: int) -> R:
        """The request `row` holds."""
        req = self.reqs[row]
        if req is None:
            raise ValueError(f"row {row} holds no request")
        return req

    def release(self, row: int) -> None:
        req = self.held(row)
        self.active[row] = False
        req.row = -1
        self.reqs[row] = None
        self._free_rows.append(row)

    def pages(self, row: int) -> np.ndarray:
        return self.page_table[row, : self.num_pages[row]]

    # ---- a step's bookkeeping ---------------------------------------------------------
    def decode_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows whose every known token but the last is in the KV cache: one token each,
        those of them whose pages are full), int64."""
        if self._core is None:
            rows = np.flatnonzero(self.active & (self.kv_len == self.length - 1))
            return rows, rows[self.num_pages[rows] * self.page_size <= self.kv_len[rows]]
        rows, need = np.empty(self.num_rows, np.int64), np.empty(self.num_rows, np.int64)
        n, k = self._core.decode_rows(self.page_size, rows, need)
        return rows[:n], need[:k]

    def add_pages(self, rows: np.ndarray, pages: np.ndarray) -> None:
        """One more page for each of rows (int64), in order: pages (int32)."""
        if self._core is None:
            self.page_table[rows, self.num_pages[rows]] = pages
            self.num_pages[rows] += 1
        else:
            self._core.add_pages(_c(rows, np.int64), _c(pages, np.int32))

    def step_input(
        self, rows: np.ndarray, q_lens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The runner's columns for rows (int64 [B]) each running q_lens (int64 [B]) tokens
        from its kv_len, past its known tokens too (the drafts a speculative decode verifies):
        (starts int64, token ids int32 [sum(q_lens)], num_pages int64, page_table int32 [B, P],
        sample bool: they end at the row's last known token)."""
        if self._core is None:
            starts = self.kv_len[rows].astype(np.int64)
            num_pages = self.num_pages[rows].astype(np.int64)
            P = int(num_pages.max()) if len(rows) else 0
            token_ids = (
                self.ids[rows, starts]
                if int(q_lens.sum()) == len(rows)
                # decodes only
                else np.concatenate(
                    [self.ids[r, k : k + n] for r, k, n in zip(rows.tolist(), starts.tolist(), q_lens.tolist())]
                )
            )
            return starts, token_ids, num_pages, self.page_table[rows, :P], starts + q_lens == self.length[rows]
        B = len(rows)
        starts, num_pages, sample = np.empty(B, np.int64), np.empty(B, np.int64), np.empty(B, bool)
        token_ids, page_table = np.empty(int(q_lens.sum()), np.int32), np.empty(B * self.page_table.shape[1], np.int32)
        P = self._core.step_input(
            _c(rows, np.int64), _c(q_lens, np.int64), starts, token_ids, num_pages, page_table, sample
        )
        return starts, token_ids, num_pages, page_table[: B * P].reshape(B, P), sample

    def reserved_tokens(self, ratio: float, clip: int) -> float:
        """Over the active rows: known tokens not yet in the KV cache, plus `ratio` of what
        each may still generate (at most `clip` a row)."""
        if self._core is not None:
            return self._core.reserved_tokens(ratio, clip)
        a = self.active
        future = np.minimum(self.max_len[a] - self.length[a], clip)
        return float(np.sum(self.length[a] - self.kv_len[a]) + ratio * np.sum(future))

    def draft(self, row: int, k: int, min_window: int, max_window: int) -> np.ndarray:
        """ngram_draft over `row`'s known tokens (a view of them: valid until the row is reused)."""
        if self._core is None:
            return ngram_draft(self.ids[row, : self.length[row]], k, min_window, max_window)
        start, n = self._core.draft(row, k, min_window, max_window)
        return self.ids[row, start : start + n]

    def append(self, rows: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Appends one sampled token (int32) to each of rows (int64): (their TOKEN_OUT records
        with token, logprob (float32), finish and completion_tokens, the rows that finished).
        A stop token counts only past min_len and wins over the length limit."""
        if self._core is None:
            length = self.length[rows]
            self.ids[rows, length] = tokens
            length += 1
            self.length[rows] = length
            finish = (length >= self.max_len[rows]).astype(np.uint8) * _LENGTH
            finish[(self.stop_ids[rows] == tokens[:, None]).any(axis=1) & (length > self.min_len[rows])] = _STOP
            events = take_records(self.events, rows)
            events["token"], events["logprob"], events["finish"] = tokens, logprobs, finish
            events["completion_tokens"] = length - self.prompt_len[rows]
            return events, rows[finish != 0].tolist()
        events, finished = np.empty(len(rows), TOKEN_OUT.dtype), np.empty(len(rows), np.int64)
        k = self._core.append(_c(rows, np.int64), _c(tokens, np.int32), _c(logprobs, np.float32), events, finished)
        return events, finished[:k].tolist()
