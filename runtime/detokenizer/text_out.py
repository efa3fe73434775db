"""TEXT_OUT records and their payload blob (protocol/records.py has the layout): the ERROR
records that end requests, several outputs merged into one, one output split by worker.

Blob order: every logprobs part first (each a multiple of 4 bytes, so they stay 4-byte
aligned), then the token-id runs (uint32), then the text deltas.
"""

from __future__ import annotations

import numpy as np

from protocol.record_bytes import concat_records, take_records
from protocol.records import TEXT_OUT, Finish, TextKind

_BLOB_ORDER = (("logprobs_off", "logprobs_len"), ("ids_off", "ids_len"), ("text_off", "text_len"))
NO_TEXT_OUT = (np.zeros(0, TEXT_OUT.dtype), np.zeros(0, np.uint8))


def error_records(
    w: int, s: int | list[int], gen: int | list[int], code: int, message, rec: np.void | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """ERROR records ending request (w, s, gen), or one per (slot, gen) of lists, each with
    `message` (all pointing at the one blob), and `rec`'s usage counts when given."""
    out = np.zeros(np.size(s), TEXT_OUT.dtype)
    out["worker"], out["slot"], out["gen"] = w, s, gen
    out["kind"], out["finish"], out["error"] = TextKind.ERROR, Finish.ERROR, code
    if rec is not None:
        out["prompt_tokens"], out["completion_tokens"] = rec["prompt_tokens"], rec["completion_tokens"]
        out["cached_tokens"] = rec["cached_tokens"]
    out["stop_token"], out["stop_index"] = -1, -1
    blob = np.frombuffer(message, np.uint8) if isinstance(message, bytes) else message
    out["text_len"] = len(blob)
    return out, blob


def split_by_worker(records: np.ndarray, blob: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """TEXT_OUT records of several workers -> {worker: (its records, its own blob)}."""
    workers = records["worker"]
    if len(records) == 0:
        return {}
    if (workers == workers[0]).all():
        return {int(workers[0]): (records, blob)}
    out = {}
    for w in np.unique(workers).tolist():
        sel = take_records(records, workers == w)
        out[w] = sel, _regather(sel, blob, [sel[off] for off, _ in _BLOB_ORDER])
    return out


def _gather(blob: np.ndarray, off: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The spans blob[off:off+length], back to back, and where each starts in the result."""
    length = length.astype(np.int64)
    end = np.cumsum(length)
    start = end - length
    total = int(end[-1]) if len(end) else 0
    src = np.repeat(off.astype(np.int64) - start, length) + np.arange(total)
    return blob[src], start.astype(np.uint32)


def merge_text_out(outs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Several (records, blob) -> one, logprobs parts still first and 4-byte aligned."""
    outs = [o for o in outs if len(o[0])]
    if len(outs) <= 1:
        return outs[0] if outs else NO_TEXT_OUT
    records = concat_records([r for r, _ in outs])
    blob = np.concatenate([b for _, b in outs])
    return records, _regather(records, blob, [_shifted(outs, off) for off, _ in _BLOB_ORDER])


def _regather(records: np.ndarray, blob: np.ndarray, offsets: list[np.ndarray]) -> np.ndarray:
    """A blob holding just `records`' payloads, in _BLOB_ORDER (`offsets`: where each field's
    spans start in `blob`); the records' offsets are set to where they are in it."""
    pieces, size = [], 0
    for (off, length), starts in zip(_BLOB_ORDER, offsets):
        data, new = _gather(blob, starts, records[length])
        records[off] = new + size
        pieces.append(data)
        size += len(data)
    return np.concatenate(pieces)


def _shifted(outs: list[tuple[np.ndarray, np.ndarray]], field: str) -> np.ndarray:
    base = np.cumsum([0] + [len(b) for _, b in outs[:-1]])
    return np.concatenate([r[field].astype(np.int64) + b for (r, _), b in zip(outs, base)])
