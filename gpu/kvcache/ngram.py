"""Prompt lookup, the n-gram drafter's search (runtime/scheduler/speculative.py drafts with it):
where the tokens a request ends with occurred before, and what followed them there. The
request table runs it in C over its own rows (step_core.c `draft`); this is its numpy form,
used where the C core cannot be built, and the reference the C one is tested against."""

from __future__ import annotations

import numpy as np


def ngram_draft(ids: np.ndarray, k: int, min_window: int, max_window: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `ids`
    (int32 [L]) of min_window to max_window tokens; none when no such suffix occurred before."""
    L = len(ids)
    if L <= min_window or k <= 0:
        return ids[:0]
    ends = np.flatnonzero(ids[: L - 1] == ids[L - 1])  # where an occurrence of the suffix may end
    if not len(ends):
        return ids[:0]
    length = np.ones(len(ends), np.int64)  # the suffix's tokens each occurrence matches
    alive = np.ones(len(ends), bool)
    for m in range(1, min(max_window, L - 1)):
        before = ends - m
        alive &= before >= 0
        alive[alive] = ids[before[alive]] == ids[L - 1 - m]
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_window:
        return ids[:0]
    end = int(ends[np.flatnonzero(length == best)[-1]])
    return ids[end + 1 : min(end + 1 + k, L)]
