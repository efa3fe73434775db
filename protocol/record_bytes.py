"""Records as rows of bytes: copies numpy would make field by field, and struct layouts that
pack or read a record (or a part of one) in one call. The layouts are protocol/records.py's."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from protocol.records import OPEN_RECORD, TOKEN_OUT, TokenKind, fields_of


def take_records(records: np.ndarray, index: np.ndarray) -> np.ndarray:
    """records[index] (an integer or boolean index), copied as whole rows of bytes: numpy
    copies these padded structured dtypes field by field, several times slower."""
    return _rows(records)[index].view(records.dtype)


def concat_records(parts: Sequence[np.ndarray]) -> np.ndarray:
    """np.concatenate of record arrays of one dtype, as whole rows of bytes (many times faster)."""
    return np.concatenate([_rows(p) for p in parts]).view(parts[0].dtype)


def record_struct(dtype: np.dtype, start: int = 0, stop: int | None = None) -> struct.Struct:
    """A struct.Struct laid out as bytes [start, stop) of one record of `dtype` (the fields in
    there, padding included; by default the whole record): it packs the fields' values (an
    array field's items in order) into a record's bytes in one call, several times faster than
    np.array([values], dtype)."""
    codes = {
        "b1": "?",
        "u1": "B",
        "u2": "H",
        "u4": "I",
        "u8": "Q",
        "i1": "b",
        "i2": "h",
        "i4": "i",
        "i8": "q",
        "f4": "f",
        "f8": "d",
    }
    stop = dtype.itemsize if stop is None else stop
    fmt, at = "=", start
    for field, offset in fields_of(dtype).values():
        if not start <= offset < stop:
            continue
        base = field.base
        fmt += f"{offset - at}x{field.itemsize // base.itemsize}{codes[base.str[1:]]}"
        at = offset + field.itemsize
    return struct.Struct(fmt + f"{stop - at}x")


# one TOKEN_OUT record's fields in order: worker, kind, finish, slot, gen, token, prompt_tokens,
# completion_tokens, cached_tokens, logprob, payload_off, payload_len, n_top, flags, error
TOKEN_OUT_STRUCT = record_struct(TOKEN_OUT.dtype)
_OPEN_STRUCT = record_struct(OPEN_RECORD)


class OpenFields(NamedTuple):
    """An OPEN record's fields, in OPEN_RECORD's order."""

    worker: int
    kind: int
    slot: int
    gen: int
    prompt_tokens: int
    min_new_tokens: int
    stop_off: int
    stop_len: int
    top_logprobs: int
    flags: int


def pack_open(
    *,
    worker: int,
    slot: int,
    gen: int,
    prompt_tokens: int,
    min_new_tokens: int,
    top_logprobs: int,
    flags: int,
    stop_off: int = 0,
    stop_len: int = 0,
) -> bytes:
    """One OPEN record's bytes (stop_off, stop_len: the stop strings' part of the push's blob)."""
    return _OPEN_STRUCT.pack(
        worker, TokenKind.OPEN, slot, gen, prompt_tokens, min_new_tokens, stop_off, stop_len, top_logprobs, flags
    )


def unpack_open(record: bytes) -> OpenFields:
    """The fields of one OPEN record's bytes, read in one call."""
    return OpenFields._make(_OPEN_STRUCT.unpack(record))


def record_fields(record: np.void) -> dict[str, Any]:
    """One record's fields as Python values, read in one call (one by one, each field is a numpy call)."""
    names = record.dtype.names
    if names is None:
        raise TypeError(f"{record.dtype} is not a record dtype")
    return dict(zip(names, record.item()))


def _rows(records: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(records).view(np.dtype((np.void, records.dtype.itemsize)))
