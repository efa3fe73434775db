"""A bad GGUF at start: `python -m runtime serve --model-path bad.gguf` prints one line that
names the file and what is wrong, and exits 1, before any server process starts; serve's
check of a good one imports no torch (the scheduler, started beside it, does)."""

import os
import struct
import subprocess
import sys

import pytest
from test_gpu_model_families_gguf import tiny_model, typed_model, write_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf("qwen3", tiny_model("qwen3"), path)
    return path.read_bytes()


def after(data: bytes, name: str) -> int:
    """Where the bytes right after the string `name` (a key or a tensor's name) are."""
    return data.index(struct.pack("<Q", len(name)) + name.encode()) + 8 + len(name)


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def serve_error(path, tmp_path) -> str:
    """The start's stderr, which must be one line naming the file, and exit status 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env["RINGSERVE_CACHE_DIR"] = str(tmp_path / "cache")  # the model directory of the lying file
    done = subprocess.run(
        [sys.executable, "-m", "runtime", "serve", "--model-path", str(path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("ringserve: ") and done.stderr.count("\n") == 1, done.stderr
    assert str(path) in done.stderr
    return done.stderr


def test_unknown_tensor_type(good, tmp_path):
    path = tmp_path / "unknown_type.gguf"
    path.write_bytes(patched(good, after(good, "blk.0.attn_q.weight") + 4 + 2 * 8, "<I", 99))
    assert "tensor blk.0.attn_q.weight has unknown type 99" in serve_error(path, tmp_path)


def test_truncated_file(good, tmp_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(good[: len(good) * 2 // 3])
    message = serve_error(path, tmp_path)
    assert "truncated: tensor" in message and "runs past the end of the file" in message


def test_metadata_that_lies_about_shapes(good, tmp_path):
    """The hyperparameters say one shape, the tensors another: found at start, not by the scheduler."""
    path = tmp_path / "lying.gguf"
    path.write_bytes(patched(good, after(good, "qwen3.feed_forward_length") + 4, "<I", 80))
    assert "tensor blk.0.ffn_gate.weight has shape (96, 64), the config implies (80, 64)" in serve_error(path, tmp_path)


def test_tensor_info_that_lies_about_its_shape(good, tmp_path):
    """A tensor claiming more rows than its data holds: overlapping the next one."""
    path = tmp_path / "long_tensor.gguf"
    path.write_bytes(patched(good, after(good, "blk.0.attn_q.weight") + 4 + 8, "<Q", 1000))
    assert "overlaps" in serve_error(path, tmp_path)


def test_a_type_no_kernel_takes(tmp_path):
    path = tmp_path / "tq.gguf"
    write_gguf("qwen3", typed_model("qwen3"), path, "TQ2_0")
    assert "tensor token_embd.weight is TQ2_0: no kernel takes it" in serve_error(path, tmp_path)


def test_serve_checks_a_good_file_without_torch(good, tmp_path):
    """A second start's check (the first makes the model directory: transformers' GGUF
    tokenizer conversion)."""
    path = tmp_path / "good.gguf"
    path.write_bytes(good)
    code = f"""
import sys
from runtime.__main__ import check_model
from runtime.config import ServerArgs
print(check_model(ServerArgs(model_path={str(path)!r})), "torch" in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env["RINGSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "False"]
