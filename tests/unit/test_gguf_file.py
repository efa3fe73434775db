"""GGUFFile against gguf.GGUFReader on files gguf.GGUFWriter writes, and each defect a file
can have: one ModelLoadError line at open naming the file and what is wrong."""

import struct

import gguf
import numpy as np
import pytest

from gpu.models.gguf_file import GGUFFile
from gpu.models.model_files import ModelLoadError

SCALARS = {
    "test.u8": ("add_uint8", 200),
    "test.i8": ("add_int8", -100),
    "test.u16": ("add_uint16", 60000),
    "test.i16": ("add_int16", -30000),
    "test.u32": ("add_uint32", 4_000_000_000),
    "test.i32": ("add_int32", -2_000_000_000),
    "test.f32": ("add_float32", 0.5),
    "test.bool": ("add_bool", True),
    "test.u64": ("add_uint64", 1 << 60),
    "test.i64": ("add_int64", -(1 << 60)),
    "test.f64": ("add_float64", 0.1),
    "test.string": ("add_string", "héllo"),
}
ARRAYS = {
    "test.array_i32": [1, -2, 3],
    "test.array_f32": [0.5, 1.5],
    "test.array_str": ["a", "bé", ""],
    "test.array_nested": [[1, 2], [3]],
}


def q8_0_blocks(rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, cols / 32 * 34] bytes of Q8_0 blocks (f16 scale, 32 int8)."""
    rng = np.random.default_rng(seed)
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = rng.uniform(0.01, 0.1, (rows, cols // 32)).astype(np.float16)[..., None].view(np.uint8)
    blocks[..., 2:] = rng.integers(-127, 128, (rows, cols // 32, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def write(path, tensors=True, **extra) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, (method, value) in SCALARS.items():
        getattr(w, method)(key, value)
    for key, value in ARRAYS.items():
        w.add_array(key, value)
    for key, value in extra.items():
        w.add_uint32(key, value)
    if tensors:
        w.add_tensor("blk.0.norm", rng.standard_normal(48).astype(np.float32))
        w.add_tensor("blk.0.f32", rng.standard_normal((3, 64)).astype(np.float32))
        w.add_tensor("blk.0.f16", rng.standard_normal((4, 32)).astype(np.float16))
        bf16 = rng.standard_normal((2, 16)).astype(np.float32).view(np.uint32) >> 16
        w.add_tensor("blk.0.bf16", bf16.astype(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
        w.add_tensor("blk.0.q8", q8_0_blocks(5, 64, 1), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("blk.0.cube", rng.standard_normal((2, 3, 8)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.gguf"
    write(path)
    return path


def test_metadata_and_tensors_equal_gguf_reader(good):
    file, reader = GGUFFile(good), gguf.GGUFReader(good)
    assert file.architecture == "llama"
    for key, (_, value) in SCALARS.items():
        assert file.metadata[key] == reader.fields[key].contents() == value  # values exact in their type
    for key, value in ARRAYS.items():
        got = file.array(key)
        if key == "test.array_nested":  # GGUFReader flattens arrays of arrays
            assert [list(a) for a in got] == value
            assert [int(x) for a in got for x in a] == reader.fields[key].contents()
        else:
            assert list(got) == reader.fields[key].contents() == value
    assert set(file.tensors) == {t.name for t in reader.tensors}
    for expected in reader.tensors:
        t = file.tensors[expected.name]
        assert t.type_name == expected.tensor_type.name
        assert t.shape == tuple(int(n) for n in reversed(expected.shape))
        assert not t.data.flags.writeable and t.data.dtype == np.uint8
        assert np.array_equal(t.data.reshape(-1), np.asarray(expected.data).reshape(-1).view(np.uint8))
        if t.type_name in ("F32", "F16", "BF16"):
            want = gguf.quants.dequantize(np.asarray(expected.data), expected.tensor_type)
            assert t.values().shape == t.shape
            assert np.array_equal(t.values().astype(np.float32), want.reshape(t.shape))
    assert file.tensors["blk.0.q8"].data.shape == (5, 2 * 34)
    assert file.tensors["blk.0.norm"].data.shape == (48 * 4,)
    assert file.tensors["blk.0.cube"].data.shape == (2, 3, 8 * 4)
    f32 = file.tensors["blk.0.f32"]
    assert np.shares_memory(f32.values(), f32.data)  # a view of the mapping, no copy
    with pytest.raises(ModelLoadError, match="blk.0.q8 is Q8_0"):
        file.tensors["blk.0.q8"].values()
    assert bytes(file.metadata_bytes) == good.read_bytes()[: file.data_offset]
    assert file.data_offset == reader.data_offset


def patched(path, at: int, fmt: str, value) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))


def after(path, name: str) -> int:
    """Where the bytes right after the string `name` (a key or a tensor's name) are."""
    data = path.read_bytes()
    at = data.index(struct.pack("<Q", len(name)) + name.encode())
    return at + 8 + len(name)


def defect(path) -> str:
    with pytest.raises(ModelLoadError) as e:
        GGUFFile(path)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def test_bad_magic(good):
    patched(good, 0, "4s", b"GGML")
    assert "not a GGUF file (bad magic)" in defect(good)


def test_unknown_version(good):
    patched(good, 4, "<I", 7)
    assert "unknown GGUF version 7" in defect(good)


@pytest.mark.parametrize("keep", [6, 20, 200])
def test_truncated_header_or_metadata(good, keep):
    good.write_bytes(good.read_bytes()[:keep])
    assert "truncated" in defect(good)


def test_truncated_tensor_data(good):
    good.write_bytes(good.read_bytes()[:-10])
    message = defect(good)
    assert "truncated: tensor" in message and "runs past the end of the file" in message


def test_string_length_past_the_end(good):
    patched(good, after(good, "test.string") + 4, "<Q", 1 << 40)
    assert "a string of 1099511627776 bytes runs past the end" in defect(good)


def test_string_in_an_array_past_the_end(good):
    patched(good, after(good, "test.array_str") + 16, "<Q", 1 << 40)
    assert "test.array_str: a string runs past the end" in defect(good)


def test_array_length_past_the_end(good):
    patched(good, after(good, "test.array_i32") + 8, "<Q", 1 << 40)
    assert "test.array_i32: an array of 1099511627776 items runs past the end" in defect(good)


def test_unknown_value_type(good):
    patched(good, after(good, "test.u32"), "<I", 13)
    assert "metadata key test.u32 has unknown value type 13" in defect(good)


def test_string_that_is_not_utf8(good):
    patched(good, after(good, "test.string") + 12, "B", 0xFF)
    assert "a string is not UTF-8" in defect(good)


def test_duplicate_key(good):
    patched(good, after(good, "test.i8") - 2, "2s", b"u8")
    assert "metadata key test.u8 appears twice" in defect(good)


def test_absurd_counts(good):
    patched(good, 8, "<Q", 1 << 40)
    assert "1099511627776 tensors" in defect(good)
    patched(good, 8, "<Q", 6)
    patched(good, 16, "<Q", 1 << 20)
    assert "1048576 metadata keys" in defect(good)


def test_unknown_tensor_type(good):
    patched(good, after(good, "blk.0.q8") + 4 + 2 * 8, "<I", 99)
    assert "tensor blk.0.q8 has unknown type 99" in defect(good)


def test_too_many_dimensions(good):
    patched(good, after(good, "blk.0.q8"), "<I", 5)
    assert "tensor blk.0.q8 has 5 dimensions" in defect(good)


def test_dimension_not_whole_blocks(good):
    patched(good, after(good, "blk.0.q8") + 4, "<Q", 48)
    assert "blk.0.q8: its rows of 48 values are not whole Q8_0 blocks of 32" in defect(good)


def test_shape_larger_than_the_data(good):
    """A tensor whose metadata claims more rows than the file holds overlaps the next one,
    or the last one runs past the end."""
    patched(good, after(good, "blk.0.f32") + 4 + 8, "<Q", 4)  # 3 rows
    assert "tensor blk.0.f16's data overlaps tensor blk.0.f32's" in defect(good)
    write(good)
    patched(good, after(good, "blk.0.cube") + 4 + 16, "<Q", 100)
    assert "runs past the end of the file" in defect(good)


def test_zero_dimension(good):
    patched(good, after(good, "blk.0.f32") + 4 + 8, "<Q", 0)
    assert "tensor blk.0.f32 has dimensions [64, 0]" in defect(good)


def test_misaligned_and_overlapping_offsets(good):
    offset_at = after(good, "blk.0.f16") + 4 + 2 * 8 + 4
    (offset,) = struct.unpack_from("<Q", good.read_bytes(), offset_at)
    patched(good, offset_at, "<Q", offset + 4)
    assert "blk.0.f16's data at offset" in defect(good) and "not aligned to 32 bytes" in defect(good)
    patched(good, offset_at, "<Q", 0)
    assert "overlaps" in defect(good)


def test_duplicate_tensor(good):
    patched(good, after(good, "blk.0.f16") - 3, "3s", b"f32")
    assert "tensor blk.0.f32 appears twice" in defect(good)


def test_alignment_that_is_not_a_power_of_two(tmp_path):
    path = tmp_path / "aligned.gguf"
    write(path, tensors=False, **{"general.alignment": 48})
    assert "general.alignment 48 is not a power of two" in defect(path)


def test_no_architecture(good):
    patched(good, after(good, "general.architecture") - 1, "1s", b"X")
    assert "no general.architecture string" in defect(good)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert "bad magic" in defect(path)
