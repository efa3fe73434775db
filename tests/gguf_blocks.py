"""Tests' GGUF blocks of a float matrix in a given type: gguf-py's quantizers for the types it
has (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), small ones of our own for Q4_K and Q6_K (plain round to
nearest, as llama.cpp's reference quantizers without their search for the best scale). The
values need not be the best ones: tests compare against gguf.quants.dequantize of these
very blocks."""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 144]: d, dmin (fp16), 12 bytes of 6-bit scales and mins of the eight
    32-value sub-blocks, 128 bytes of nibbles; value = d * sc * q - dmin * m."""
    n = len(blocks)
    sub = blocks.reshape(n, 8, 32)
    mins = np.maximum(-sub.min(-1), 0)  # m >= 0: the sub-block's offset below zero
    scales = (sub.max(-1) + mins) / 15
    d = (scales.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scales / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.round((sub + (dmin[:, None] * m)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)  # [n, 8, 32]
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    nibbles = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # sub-block 2c low, 2c + 1 high
    return np.concatenate([_fp16_bytes(d).reshape(n, 2), _fp16_bytes(dmin).reshape(n, 2), packed, nibbles], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 210]: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
    of 16-value groups, d (fp16); value = d * scale * (q - 32)."""
    n = len(blocks)
    groups = blocks.reshape(n, 16, 16)
    amax = np.abs(groups).max(-1)
    group_scale = amax / 31
    d = (group_scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(group_scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.round(groups / np.where(step != 0, step, 1)[..., None]) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half, quarter, l]
    ql = np.concatenate([q[:, :, 0] | (q[:, :, 2] << 4), q[:, :, 1] | (q[:, :, 3] << 4)], axis=2)  # [n, 2, 64]
    hi = q >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [n, 2, 32]
    return np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _fp16_bytes(d).reshape(n, 2)], axis=1
    )


OWN = {"Q4_K": _q4_k, "Q6_K": _q6_k}


def quantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [N, K] -> uint8 [N, row bytes]: the rows as blocks of `type_name`."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name not in OWN:
        return gguf.quants.quantize(data.astype(np.float32), qtype)
    N, K = data.shape
    rows = OWN[type_name](data.astype(np.float32).reshape(-1, QK_K))
    return rows.reshape(N, -1)


def add_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, type_name: str) -> None:
    """data float32 [N, K] (or 1-D for F32) written as `type_name` (F32, F16 or a block type)."""
    if type_name in ("F32", "F16"):
        writer.add_tensor(name, data.astype(np.float32 if type_name == "F32" else np.float16))
        return
    qtype = gguf.GGMLQuantizationType[type_name]
    writer.add_tensor(name, quantize(data, type_name), raw_dtype=qtype)


def dequantize(data: np.ndarray, type_name: str) -> np.ndarray:
    """What a reader of the blocks sees: float32 [N, K]."""
    if type_name in ("F32", "F16"):
        return data.astype(type_name.lower().replace("f", "float")).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(quantize(data, type_name), qtype).astype(np.float32)
