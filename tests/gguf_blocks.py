"""Tests' GGUF blocks of a float matrix in a given type, written by gpu/quant/gguf_quantize.py
(gguf-py's quantizers where it has them, plain round to nearest for the others). The values
need not be the best ones: tests compare against gguf.quants.dequantize of these very blocks."""

from __future__ import annotations

import gguf
import numpy as np

from gpu.quant.gguf_quantize import quantize


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
