"""A weight used where it lies in a memory-mapped GGUF file: a projection's [N, K] blocks
multiplied by the block kernels (gpu/quant/gguf_types.py), the embedding's rows dequantized
on demand. Nothing is copied out of the mapping and nothing is written to it.

A fused projection (q, k, v -> qkv; gate, up -> gate_up) is the list of its GGUF tensors:
each part's product goes into its column slice of one output through the kernels' ldy, so
the parts may even be of different types (llama.cpp's Q4_K_M mixes Q4_K and Q6_K)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu.models.model_files import ModelLoadError
from gpu.quant.gguf_types import ACTIVATIONS, BLOCK_TYPES, FLOAT_TYPES, TypeKernels, type_kernels

if TYPE_CHECKING:
    from gpu.models.gguf_file import GGUFTensor


def mapped_tensor(array: np.ndarray) -> torch.Tensor:
    """A torch view of a read-only numpy view of the mapping. torch warns that it cannot
    mark such a tensor read-only; nothing here writes to weights, so that warning alone is
    silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


@dataclass(frozen=True)
class WeightPart:
    """One GGUF tensor of a (fused) weight: rows [offset, offset + rows) of it."""

    name: str
    type_name: str
    rows: int
    offset: int
    data: np.ndarray  # uint8 [rows, row bytes], read-only view of the mapping
    address: int  # of data's first byte
    values: torch.Tensor | None  # F32 / F16 / BF16: the [rows, K] tensor over the mapping; None for blocks
    kernels: TypeKernels | None  # the block kernels; None for float types
    # a copy in another layout (gpu/quant/blocks.py's packed K-quants, larger than their blocks)
    # keeps the blocks it was made from for products of fewer than in_place_below tokens
    in_place: WeightPart | None = None
    in_place_below: int = 0

    def for_tokens(self, T: int) -> WeightPart:
        """The part a product of T tokens reads: the blocks in place below in_place_below."""
        return self.in_place if self.in_place is not None and T < self.in_place_below else self

    def float_values(self) -> torch.Tensor:
        """A float type's [rows, K] values as float32 (F32: the mapping itself)."""
        if self.values is None:
            raise TypeError(f"{self.name} is {self.type_name}: blocks, not values")
        return self.values.float()


def _part(tensor: GGUFTensor, offset: int) -> WeightPart:
    if len(tensor.shape) != 2:
        raise ModelLoadError(f"GGUF tensor {tensor.name}: a matrix was expected, its shape is {tensor.shape}")
    rows, K = tensor.shape
    if tensor.type_name in FLOAT_TYPES:
        return WeightPart(
            tensor.name, tensor.type_name, rows, offset, tensor.data, 0, mapped_tensor(tensor.values()), None
        )
    kernels = type_kernels(tensor.name, tensor.type_name)
    if K % BLOCK_TYPES[tensor.type_name].block_elements:
        raise ModelLoadError(f"GGUF tensor {tensor.name}: its {K} columns are not whole {tensor.type_name} blocks")
    return WeightPart(tensor.name, tensor.type_name, rows, offset, tensor.data, tensor.data.ctypes.data, None, kernels)


class GGUFWeight:
    """An [N, K] weight: the rows of `tensors` one after another, multiplied with
    `activations` "f32" (x as it is: the exact product of the blocks' values, up to the order
    of sums) or "q8" (x quantized to int8 per block, llama.cpp's arithmetic)."""

    def __init__(self, tensors: list[GGUFTensor], activations: str) -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
        widths = {t.shape[-1] for t in tensors}
        if len(widths) != 1:
            raise ModelLoadError(
                "GGUF tensors fused into one weight differ in width: "
                + ", ".join(f"{t.name} {t.shape}" for t in tensors)
            )
        parts, offset = [], 0
        for t in tensors:
            parts.append(_part(t, offset))
            offset += parts[-1].rows
        self.parts = tuple(parts)
        self.shape = (offset, widths.pop())
        self.activations = activations

    @classmethod
    def of_parts(cls, parts: tuple[WeightPart, ...], shape: tuple[int, int], activations: str) -> GGUFWeight:
        """A weight of parts made elsewhere (gpu/quant/blocks.py's repacked copy)."""
        weight = cls.__new__(cls)
        weight.parts, weight.shape, weight.activations = parts, shape, activations
        return weight

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(p.type_name for p in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes the weight reads: its parts' (the file's, or a packed copy's), and the blocks a
        packed part keeps for products of few tokens."""
        return sum(p.data.nbytes + (0 if p.in_place is None else p.in_place.data.nbytes) for p in self.parts)

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x: float32 [T, K] -> [T, N] = x @ W^T, written into `out` (float32 [T, N], contiguous)
        when given."""
        N, K = self.shape
        x, y = self._operands(x, out, N)
        T = x.shape[0]
        threads = torch.get_num_threads()
        for p in self.parts:
            if p.kernels is None:
                y[:, p.offset : p.offset + p.rows] = x @ p.float_values().t()
                continue
            columns = y.data_ptr() + 4 * p.offset  # the part's column slice, row stride N
            p = p.for_tokens(T)
            assert p.kernels is not None  # the blocks a packed part was made from have them too
            if p.kernels.gemm[self.activations](x.data_ptr(), T, K, p.address, p.rows, columns, N, threads):
                raise MemoryError(f"no memory for the int8 copy of x {tuple(x.shape)}")
        return y

    def gated(self, x: torch.Tensor, gelu: bool, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """x: float32 [T, K] -> act(gate) * up [T, N/2] for gate, up the halves of x @ W^T (an MLP's
        fused gate and up; act GELU-tanh or SiLU, layer_cpu.c's gated_mul), in one product that
        never writes x @ W^T (into `out`, contiguous float32 [T, N/2], when given); None where the
        weight has no such product: parts of its own, a type without one (a packed 32-block type's
        only), halves that are not whole chunks of the packed rows."""
        kernels = self.gating
        if kernels is None or kernels.gated is None:
            return None
        N, K = self.shape
        x, y = self._operands(x, out, N // 2)
        failed = kernels.gated(
            x.data_ptr(),
            x.shape[0],
            K,
            self.parts[0].address,
            N,
            y.data_ptr(),
            N // 2,
            int(gelu),
            torch.get_num_threads(),
        )
        if failed == -2:
            return None
        if failed:
            raise MemoryError(f"no memory for the int8 copy of x {tuple(x.shape)} or the gated product's scratch")
        return y

    @property
    def gating(self) -> TypeKernels | None:
        """The kernels of the weight's one part where they hold a product of act(gate) * up
        (gated()'s, the C decode loop's), else None."""
        kernels = self.parts[0].kernels if len(self.parts) == 1 else None
        return kernels if kernels is not None and kernels.gated is not None else None

    def _operands(self, x: torch.Tensor, out: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x checked as float32 [T, K] (made contiguous), and the product's float32 [T, width]: `out`
        checked, or a new tensor."""
        K = self.shape[1]
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K:
            raise ValueError(f"x: expected float32 [T, {K}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        T = x.shape[0]
        if out is None:
            return x, torch.empty(T, width, dtype=torch.float32)
        if out.dtype != torch.float32 or out.shape != (T, width) or not out.is_contiguous():
            raise ValueError(f"out: expected contiguous float32 [{T}, {width}], got {out.dtype} {tuple(out.shape)}")
        return x, out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: int64 [n] -> float32 [n, K], the weight's rows ids dequantized (an embedding lookup)."""
        N, K = self.shape
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= N):
            raise IndexError(f"row ids out of range [0, {N})")
        if len(self.parts) != 1:
            raise ValueError("rows() of a fused weight")
        p = self.parts[0]
        if p.kernels is None:
            return p.float_values()[ids]
        out = torch.empty(ids.numel(), K, dtype=torch.float32)
        p.kernels.get_rows(p.address, K, ids.data_ptr(), ids.numel(), out.data_ptr())
        return out

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: every value as gguf-py dequantizes it (a copy: for references and
        --quantization none)."""
        N, K = self.shape
        out = torch.empty(N, K, dtype=torch.float32)
        for p in self.parts:
            if p.kernels is None:
                out[p.offset : p.offset + p.rows] = p.float_values()
                continue
            ids = torch.arange(p.rows, dtype=torch.int64)
            p.kernels.get_rows(p.address, K, ids.data_ptr(), p.rows, out[p.offset].data_ptr())
        return out
