"""GGUF blocks of a float matrix in each block type the C kernels take (gguf_types.BLOCK_TYPES):
gguf-py's own quantizers where it has them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), numpy ones here for
the others (Q2_K .. Q6_K, IQ4_NL, IQ4_XS). Those are plain round to nearest, as llama.cpp's
reference quantizers without their search for the best scales: good enough to measure a type's
arithmetic (perf/quality_types.py) and to test kernels against gguf.quants.dequantize of the
very blocks written, not a replacement for llama-quantize.

Values beyond fp16's range saturate at it (Q4_1's and Q5_1's offsets are fp16 values
themselves, and a scale past it would be written inf, read back as inf and NaN); a zero block
gets a zero scale and zero values, never a division by zero."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

QK_K = 256
IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
_IQ4_MIDPOINTS = (IQ4_VALUES[1:] + IQ4_VALUES[:-1]) / 2
_FP16_MAX = float(np.finfo(np.float16).max)
_CHUNK_BLOCKS = 1 << 15  # blocks quantized at a time: a vocabulary-sized matrix's temporaries stay ~100 MB

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def block_elements(type_name: str) -> int:
    """Values one block holds: a row's K must be a multiple of it."""
    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def quantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """float [N, K] -> uint8 [N, row bytes]: each row as blocks of `type_name` (one of TYPES)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    x = np.clip(np.ascontiguousarray(data, dtype=np.float32), -_FP16_MAX, _FP16_MAX)
    own = _OWN.get(type_name)
    if own is None:
        return gguf.quants.quantize(x, qtype)
    N, K = x.shape
    blocks = x.reshape(-1, block_elements(type_name))
    out = np.concatenate([own(blocks[a : a + _CHUNK_BLOCKS]) for a in range(0, len(blocks), _CHUNK_BLOCKS)])
    return out.reshape(N, -1)


def _fp16(v: np.ndarray) -> np.ndarray:
    """The fp16 a scale is stored as (saturated, not inf)."""
    return np.clip(v, -_FP16_MAX, _FP16_MAX).astype(np.float16)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe(v: np.ndarray) -> np.ndarray:
    """A divisor: 0 becomes 1 (what it divides is then stored against a zero scale anyway)."""
    return np.where(v != 0, v, 1)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


def _iq4_index(v: np.ndarray) -> np.ndarray:
    """The index of the IQ4 value nearest each of v."""
    return np.searchsorted(_IQ4_MIDPOINTS, v).astype(np.uint8)


def _scales_and_mins(sub: np.ndarray, nmax: int, scale_max: int) -> tuple[np.ndarray, ...]:
    """Asymmetric sub-blocks [n, S, L], value = d * sc * q - dmin * m with q in 0..nmax and
    sc, m in 0..scale_max: (d, dmin as stored, sc, m, q), each sub-block's range [min(x, 0), max]
    spread over the levels as llama.cpp's make_qkx quants start from."""
    mins = np.maximum(-sub.min(-1), 0)  # m >= 0: the sub-block's offset below zero
    scales = (sub.max(-1) + mins) / nmax
    d = _fp16(scales.max(-1) / scale_max).astype(np.float32)
    dmin = _fp16(mins.max(-1) / scale_max).astype(np.float32)
    sc = np.clip(np.round(scales / _safe(d)[:, None]), 0, scale_max).astype(np.uint8)
    m = np.clip(np.round(mins / _safe(dmin)[:, None]), 0, scale_max).astype(np.uint8)
    step = d[:, None] * sc
    q = np.round((sub + (dmin[:, None] * m)[..., None]) / _safe(step)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, nmax).astype(np.uint8)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 84]: 16 bytes of 4-bit scales (low) and mins (high) of the sixteen
    16-value groups, 64 bytes of 2-bit values, d, dmin (fp16); value = d * sc * q - dmin * m."""
    n = len(blocks)
    d, dmin, sc, m, q = _scales_and_mins(blocks.reshape(n, 16, 16), 3, 15)
    q = q.reshape(n, 2, 4, 32)  # [n, half, shift, l]: value 128 h + 32 s + l is bits 2s of byte 32 h + l
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return np.concatenate(
        [sc | (m << 4), qs.reshape(n, 64), _fp16_bytes(d).reshape(n, 2), _fp16_bytes(dmin).reshape(n, 2)], axis=1
    )


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 110]: 32 bytes of high bits, 64 of low 2-bit pairs, 12 of 6-bit signed
    scales of the sixteen 16-value groups, d (fp16); value = d * (sc - 32) * q, q in -4..3."""
    n = len(blocks)
    groups = blocks.reshape(n, 16, 16)
    scales = _signed_absmax(groups) / -4  # the largest magnitude lands on -4, the side with the extra level
    d = _fp16(_signed_absmax(scales) / -32).astype(np.float32)
    sc = np.clip(np.round(scales / _safe(d)[:, None]), -32, 31)
    step = d[:, None] * sc
    q = np.clip(np.round(groups / _safe(step)[..., None]), -4, 3).astype(np.int8) + 4  # 0..7
    q = q.astype(np.uint8).reshape(n, 256)
    low = (q & 3).reshape(n, 2, 4, 32)
    qs = low[:, :, 0] | (low[:, :, 1] << 2) | (low[:, :, 2] << 4) | (low[:, :, 3] << 6)
    high = (q >> 2).reshape(n, 8, 32)  # value 32 b + l is bit b of byte l
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    u = (sc + 32).astype(np.uint8)  # 0..63
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:8] = (u[:, 0:8] & 0xF) | ((u[:, 8:16] & 0xF) << 4)
    top = (u >> 4).reshape(n, 4, 4)  # [n, k, j]: scale 4 k + j's two high bits are bits 2k of byte 8 + j
    packed[:, 8:12] = np.bitwise_or.reduce(top << (2 * np.arange(4, dtype=np.uint8))[None, :, None], axis=1)
    return np.concatenate([hmask, qs.reshape(n, 64), packed, _fp16_bytes(d).reshape(n, 2)], axis=1)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and mins."""
    packed = np.zeros((len(sc), 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return packed


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 144]: d, dmin (fp16), 12 bytes of 6-bit scales and mins of the eight
    32-value sub-blocks, 128 bytes of nibbles; value = d * sc * q - dmin * m."""
    n = len(blocks)
    d, dmin, sc, m, q = _scales_and_mins(blocks.reshape(n, 8, 32), 15, 63)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # sub-block 2c low, 2c + 1 high
    head = [_fp16_bytes(d).reshape(n, 2), _fp16_bytes(dmin).reshape(n, 2), _pack_k_scales(sc, m)]
    return np.concatenate([*head, nibbles], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 176]: Q4_K's fields with 32 bytes of fifth bits before the nibbles."""
    n = len(blocks)
    d, dmin, sc, m, q = _scales_and_mins(blocks.reshape(n, 8, 32), 31, 63)
    low = q & 0xF
    nibbles = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)
    qh = np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)  # sub-block b: bit b
    head = [_fp16_bytes(d).reshape(n, 2), _fp16_bytes(dmin).reshape(n, 2), _pack_k_scales(sc, m)]
    return np.concatenate([*head, qh, nibbles], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 210]: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
    of 16-value groups, d (fp16); value = d * scale * (q - 32)."""
    n = len(blocks)
    groups = blocks.reshape(n, 16, 16)
    group_scale = np.abs(groups).max(-1) / 31
    d = _fp16(group_scale.max(-1) / 127).astype(np.float32)
    sc = np.clip(np.round(group_scale / _safe(d)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.round(groups / _safe(step)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half, quarter, l]
    low = q & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)  # [n, 2, 64]
    hi = q >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _fp16_bytes(d).reshape(n, 2)], axis=1
    )


def _iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """[n, 32] -> [n, 18]: d (fp16), 16 bytes of indices into IQ4_VALUES (value i low nibble
    of byte i, value 16 + i high); value = d * IQ4_VALUES[q]."""
    n = len(blocks)
    d = _fp16(_signed_absmax(blocks) / IQ4_VALUES[0]).astype(np.float32)  # the largest magnitude lands on -127
    q = _iq4_index(blocks / _safe(d)[:, None])
    return np.concatenate([_fp16_bytes(d).reshape(n, 2), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def _iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 136]: d (fp16), 2 bytes of the high 2 bits and 4 of the low 4 of eight
    6-bit signed sub-block scales, 128 bytes of indices into IQ4_VALUES;
    value = d * (sc - 32) * IQ4_VALUES[q]."""
    n = len(blocks)
    sub = blocks.reshape(n, 8, 32)
    scales = _signed_absmax(sub) / IQ4_VALUES[0]
    d = _fp16(_signed_absmax(scales) / -32).astype(np.float32)
    sc = np.clip(np.round(scales / _safe(d)[:, None]), -32, 31)
    q = _iq4_index(sub / _safe(d[:, None] * sc)[..., None])  # [n, 8, 32]
    u = (sc + 32).astype(np.uint16)
    scales_h = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    low = (u & 0xF).astype(np.uint8)
    scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
    return np.concatenate([_fp16_bytes(d).reshape(n, 2), scales_h.reshape(n, 1).view(np.uint8), scales_l, qs], axis=1)


_OWN: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
