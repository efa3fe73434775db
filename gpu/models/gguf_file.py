"""A GGUF file read where it lies: the whole file memory-mapped read-only, its header,
metadata and tensor infos parsed at open, every tensor a view of the mapping.

Its own parser rather than gguf.GGUFReader, which turns every field, the whole vocabulary
included, into Python objects at open (perf/results/gguf_load.md). Arrays are read on demand
(GGUFFile.array); at open a string array is only walked to find where it ends.

Everything the file says is checked at open, so that a defect is one ModelLoadError line
naming the file and what is wrong, never a crash in a kernel later."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from gpu.models.load_error import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; nothing in use still writes it
DEFAULT_ALIGNMENT = 32
# bounds far above any real file, so that a corrupt count is an error rather than a long loop
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS

STRING, ARRAY = 8, 9  # the value types that are not fixed-size
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
SCALAR_DTYPES = {t: np.dtype(f) for t, f in SCALAR_FORMATS.items()}
U64 = struct.Struct("<Q")
TYPE_NAMES = {t.value: t.name for t in GGMLQuantizationType}
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


@dataclass(frozen=True)
class GGUFArray:
    """Where an array value lies in the file; GGUFFile.array reads it."""

    item_type: int
    count: int
    offset: int  # of its first item


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # as gguf.GGMLQuantizationType names it: "F32", "F16", "BF16", "Q4_K", ...
    shape: tuple[int, ...]  # torch order (ggml's ne reversed): [N, K] for N rows of K values
    data: np.ndarray  # read-only uint8 view of the mapping: [..., row bytes], or [nbytes] for 1-D

    def values(self) -> np.ndarray:
        """An F32 / F16 tensor as a view of the mapping of its own dtype; BF16 as float32 (numpy
        has no bfloat16: the one copy)."""
        if self.type_name in FLOAT_DTYPES:
            return self.data.view(FLOAT_DTYPES[self.type_name]).reshape(self.shape)
        if self.type_name == "BF16":
            return (self.data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(self.shape)
        raise ModelLoadError(f"GGUF tensor {self.name} is {self.type_name}: its values are blocks, not floats")


class _Cursor:
    """Reads the header forward from `pos`; every read past the end is the file's one error."""

    def __init__(self, buf: np.ndarray, path: Path) -> None:
        # a memoryview: struct and str read from it several times faster than from the array
        self.buf, self.path, self.pos, self.size = buf.data, path, 0, len(buf)
        self.what = "the header"  # what is being read, for the error

    def fail(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"GGUF file {self.path}: {problem}")

    def need(self, n: int) -> int:
        start = self.pos
        if n > self.size - start:
            raise self.fail(f"truncated: {self.what} runs past the end of the file ({self.size} bytes)")
        self.pos += n
        return start

    def scalar(self, value_type: int) -> int | float | bool:
        fmt = SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, self.buf, self.need(struct.calcsize(fmt)))[0]

    def u32(self) -> int:
        return int(self.scalar(4))

    def u64(self) -> int:
        return int(self.scalar(10))

    def string(self) -> str:
        n = self.u64()
        if n > self.size - self.pos:
            raise self.fail(f"{self.what}: a string of {n} bytes runs past the end of the file")
        try:
            return str(self.buf[self.need(n) : self.pos], "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{self.what}: a string is not UTF-8") from None

    def strings(self, count: int, decode: bool) -> tuple[list[str], int]:
        """`count` strings from pos (a vocabulary: the one loop here that must be fast), and
        where they end; decode=False only walks them."""
        buf, pos, out = self.buf, self.pos, []
        try:
            for _ in range(count):
                (n,) = U64.unpack_from(buf, pos)
                pos += 8 + n
                if decode:
                    out.append(str(buf[pos - n : pos], "utf-8"))
        except struct.error:
            pos = self.size + 1
        except UnicodeDecodeError:
            raise self.fail(f"{self.what}: a string is not UTF-8") from None
        if pos > self.size:
            raise self.fail(f"{self.what}: a string runs past the end of the file")
        return out, pos

    def value_type(self) -> int:
        t = self.u32()
        if t not in SCALAR_FORMATS and t not in (STRING, ARRAY):
            raise self.fail(f"{self.what} has unknown value type {t}")
        return t

    def array(self) -> GGUFArray:
        item_type, count = self.value_type(), self.u64()
        least = SCALAR_DTYPES[item_type].itemsize if item_type in SCALAR_DTYPES else 8  # a string's length
        if count > (self.size - self.pos) // least:
            raise self.fail(f"{self.what}: an array of {count} items runs past the end of the file")
        array = GGUFArray(item_type, count, self.pos)
        if item_type in SCALAR_DTYPES:
            self.pos += count * least
        elif item_type == STRING:
            self.pos = self.strings(count, decode=False)[1]
        else:
            for _ in range(count):
                self.array()
        return array

    def value(self, value_type: int) -> object:
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            return self.array()
        return self.scalar(value_type)


class GGUFFile:
    """A GGUF file (v2 / v3), memory-mapped read-only. ModelLoadError at open for anything
    wrong with it: bad magic or version, a header or metadata cut short, a length past the
    end, an unknown value or tensor type, absurd counts, a tensor not whole blocks, data
    misaligned, overlapping or past the end of the file."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            buf = np.memmap(self.path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read GGUF file {self.path}: {e}") from None
        self._buf = buf
        cur = _Cursor(buf, self.path)
        if buf[:4].tobytes() != MAGIC:
            raise cur.fail("not a GGUF file (bad magic)")
        cur.need(4)
        version = cur.u32()
        if version not in VERSIONS:
            raise cur.fail(f"unknown GGUF version {version} (this reader takes {' and '.join(map(str, VERSIONS))})")
        n_tensors, n_keys = cur.u64(), cur.u64()
        if n_tensors > MAX_TENSORS or n_keys > MAX_KEYS:
            raise cur.fail(f"{n_tensors} tensors and {n_keys} metadata keys: more than any model has")
        self.metadata: dict[str, object] = {}
        for i in range(n_keys):
            cur.what = f"metadata key {i}"
            key = cur.string()
            cur.what = f"metadata key {key}"
            if key in self.metadata:
                raise cur.fail(f"metadata key {key} appears twice")
            self.metadata[key] = cur.value(cur.value_type())
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise cur.fail(f"general.alignment {alignment!r} is not a power of two")
        infos = [self._tensor_info(cur, i) for i in range(n_tensors)]
        self.data_offset = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        end_of_previous, previous = 0, ""
        for name, shape, type_name, offset, nbytes in sorted(infos, key=lambda info: info[3]):
            if name in self.tensors:
                raise cur.fail(f"tensor {name} appears twice")
            if offset % alignment:
                raise cur.fail(f"tensor {name}'s data at offset {offset} is not aligned to {alignment} bytes")
            if offset < end_of_previous:
                raise cur.fail(f"tensor {name}'s data overlaps tensor {previous}'s")
            start = self.data_offset + offset
            if start + nbytes > cur.size:
                raise cur.fail(
                    f"truncated: tensor {name}'s data (bytes {start} to {start + nbytes}) runs past the end "
                    f"of the file ({cur.size} bytes)"
                )
            data = buf[start : start + nbytes]
            if len(shape) > 1:
                data = data.reshape(*shape[:-1], nbytes // int(np.prod(shape[:-1])))
            self.tensors[name] = GGUFTensor(name, type_name, shape, data)
            end_of_previous, previous = offset + nbytes, name
        architecture = self.metadata.get("general.architecture")
        if not isinstance(architecture, str):
            raise cur.fail("no general.architecture string in its metadata")
        self.architecture = architecture

    @staticmethod
    def _tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], str, int, int]:
        cur.what = f"tensor info {i}"
        name = cur.string()
        cur.what = f"tensor {name}'s info"
        n_dims = cur.u32()
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        ne = [cur.u64() for _ in range(n_dims)]
        type_id = cur.u32()
        offset = cur.u64()
        type_name = TYPE_NAMES.get(type_id)
        if type_name is None or GGMLQuantizationType(type_id) not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name} has unknown type {type_id}")
        block_elements, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        if any(n < 1 or n >= 1 << 40 for n in ne):
            raise cur.fail(f"tensor {name} has dimensions {ne}")
        if ne[0] % block_elements:
            raise cur.fail(
                f"tensor {name}: its rows of {ne[0]} values are not whole {type_name} blocks of {block_elements}"
            )
        nbytes = ne[0] // block_elements * block_bytes * int(np.prod(ne[1:], dtype=np.int64))
        if nbytes >= 1 << 48:
            raise cur.fail(f"tensor {name} has dimensions {ne}")
        return name, tuple(reversed(ne)), type_name, offset, nbytes

    @property
    def metadata_bytes(self) -> memoryview:
        """The file up to its tensor data: the header, the metadata (the tokenizer's included)
        and the tensor infos."""
        return self._buf[: min(self.data_offset, len(self._buf))].data

    def array(self, key: str) -> list | np.ndarray:
        """The array value of `key`: numbers as a read-only numpy view of the mapping, strings
        (a vocabulary) as a list of str, arrays of arrays as a list of these."""
        value = self.metadata.get(key)
        if not isinstance(value, GGUFArray):
            raise KeyError(f"{self.path}: metadata key {key} is not an array")
        return self._read_array(value)

    def _read_array(self, value: GGUFArray) -> list | np.ndarray:
        if value.item_type in SCALAR_DTYPES:
            dtype = SCALAR_DTYPES[value.item_type]
            return self._buf[value.offset : value.offset + value.count * dtype.itemsize].view(dtype)
        cur = _Cursor(self._buf, self.path)  # the lengths were checked at open
        cur.pos = value.offset
        if value.item_type == STRING:
            return cur.strings(value.count, decode=True)[0]
        return [self._read_array(cur.array()) for _ in range(value.count)]
