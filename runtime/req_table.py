"""Per-row state of the running requests as numpy arrays, so that a step's bookkeeping
(page needs, token append, finish checks, token-out records) is a few vectorised ops over
the batch instead of a Python loop over requests (SGLang's req_to_token pool).

A row is held from admission to finish/abort/retraction and is the same row index the
model runner keeps its per-request sampler state in.
"""
from __future__ import annotations

import numpy as np

from ipc.records import TOKEN_OUT
from runtime.request import Request

MAX_STOP_IDS = 32  # eos ids + stop_token_ids per request


class ReqTable:
    def __init__(self, num_rows: int, max_seq_len: int, page_size: int) -> None:
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
        self.reqs: list[Request | None] = [None] * num_rows
        self._free_rows = list(range(num_rows - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_active(self) -> int:
        return self.num_rows - len(self._free_rows)

    def admit(self, req: Request, fill: np.ndarray, max_len: int, stop_ids: np.ndarray) -> int:
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
        self.stop_ids[row, :len(stop_ids)] = stop_ids
        self.arrival[row] = req.arrival
        ev = self.events[row:row + 1]
        ev["worker"], ev["slot"], ev["gen"] = req.worker, req.slot, req.generation
        ev["prompt_tokens"], ev["cached_tokens"] = p, max(req.cached_tokens, 0)
        self.active[row] = True
        self.reqs[row] = req
        req.row = row
        return row

    def release(self, row: int) -> None:
        self.active[row] = False
        self.reqs[row].row = -1
        self.reqs[row] = None
        self._free_rows.append(row)

    def pages(self, row: int) -> np.ndarray:
        return self.page_table[row, :self.num_pages[row]]

    def decode_rows(self) -> np.ndarray:
        """Rows whose every known token but the last is in the KV cache: one token each."""
        return np.flatnonzero(self.active & (self.kv_len == self.length - 1))
