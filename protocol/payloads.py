"""The payload blob of one push and what goes in it: stop strings, and the logprobs of the
TOKEN_OUT and TEXT_OUT records (protocol/records.py says which record carries which)."""

from __future__ import annotations

import numpy as np


class PayloadBuilder:
    """Collects the payloads of one push into one blob; each part starts 4-byte aligned."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, data: bytes | np.ndarray) -> tuple[int, int]:
        """Appends `data`; returns (offset, length) in bytes, relative to the blob."""
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        pad = -self._size % 4
        if pad:
            self._parts.append(b"\0" * pad)
            self._size += pad
        off = self._size
        self._parts.append(raw)
        self._size += len(raw)
        return off, len(raw)

    def blob(self) -> bytes:
        return b"".join(self._parts)


def encode_strings(strings: tuple[str, ...] | list[str]) -> bytes:
    """[count u32][count x length u32][UTF-8 bytes]: any string, NULs included."""
    if not strings:
        return _NO_STRINGS
    encoded = [s.encode() for s in strings]
    head = np.array([len(encoded)] + [len(e) for e in encoded], np.uint32).tobytes()
    return head + b"".join(encoded)


_NO_STRINGS = bytes(4)


def decode_strings(buf: bytes | np.ndarray) -> tuple[str, ...]:
    raw = bytes(buf)
    count = int.from_bytes(raw[:4], "little")
    if not count:
        return ()
    lengths = np.frombuffer(raw, np.uint32, count, offset=4).tolist()
    pos, out = 4 + 4 * count, []
    for n in lengths:
        out.append(raw[pos : pos + n].decode())
        pos += n
    return tuple(out)


def pack_top_logprobs(ids: np.ndarray, logprobs: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Token-out top-N payload for B records at once. ids, logprobs: [B, N].

    Record i's part is [N x u32 ids][N x f32 logprobs]; returns (blob, offsets [B])."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape != np.shape(logprobs):
        raise ValueError("top logprobs must be two [B, N] arrays of one shape")
    b, n = ids.shape
    rows = np.concatenate([ids.astype(np.uint32), np.asarray(logprobs, np.float32).view(np.uint32)], axis=1)
    return rows.tobytes(), np.arange(b, dtype=np.uint32) * np.uint32(8 * n)


def unpack_top_logprobs(part: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of one record's part of pack_top_logprobs: (ids [N] u32, logprobs [N] f32)."""
    words = np.frombuffer(part, np.uint32, 2 * n)
    return words[:n], words[n:].view(np.float32)


def pack_logprobs(
    ids: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray | None = None, top_logprobs: np.ndarray | None = None
) -> bytes:
    """Text-out logprobs of the T tokens a delta covers: [T u32 ids][T f32][T*N u32 top ids][T*N f32]."""
    parts = [np.asarray(ids, np.uint32), np.asarray(logprobs, np.float32)]
    if top_ids is not None:
        parts += [np.asarray(top_ids, np.uint32).ravel(), np.asarray(top_logprobs, np.float32).ravel()]
    return b"".join(p.tobytes() for p in parts)


def unpack_logprobs(
    part: np.ndarray, n_tokens: int, n_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of pack_logprobs: ids [T], logprobs [T], top_ids [T, N], top_logprobs [T, N]."""
    t, k = n_tokens, n_top
    words = np.frombuffer(part, np.uint32, 2 * t + 2 * t * k)
    return (
        words[:t],
        words[t : 2 * t].view(np.float32),
        words[2 * t : 2 * t + t * k].reshape(t, k),
        words[2 * t + t * k :].view(np.float32).reshape(t, k),
    )


def pack_prompt_logprobs(
    ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
) -> bytes:
    """Prompt logprobs of T positions with N alternatives each: pack_logprobs' layout, then each
    prompt token's rank in the vocabulary ([T u32], 1 for the likeliest; vLLM reports it)."""
    return pack_logprobs(ids, logprobs, top_ids, top_logprobs) + np.asarray(ranks, np.uint32).tobytes()


def unpack_prompt_logprobs(
    part: np.ndarray, n_positions: int, n_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of pack_prompt_logprobs: ids [T], logprobs [T], ranks [T], top_ids [T, N], top_logprobs [T, N]."""
    t = n_positions
    ids, logprobs, top_ids, top_logprobs = unpack_logprobs(part, t, n_top)
    ranks = np.frombuffer(part, np.uint32, t, offset=4 * (2 * t + 2 * t * n_top))
    return ids, logprobs, ranks, top_ids, top_logprobs
