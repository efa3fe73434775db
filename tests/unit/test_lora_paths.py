"""/load_lora_adapter's `lora_path` under --lora-allowed-dirs: a directory inside one of them
(its links resolved) loads; anything else is a 400 naming lora_path: a path outside, `..` out, a
link inside that leads out (the directory, or one of the files the engine reads), and a path
outside that does not exist (the same answer: whether it exists is not told); a GGUF adapter
file alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from httpapi.errors import APIError
from httpapi.lora_requests import parse_load_lora
from protocol.lora import ADAPTER_FILES


def adapter_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    for f in ADAPTER_FILES:
        (path / f).write_text("{}")
    return path


def load(path: str | Path, allowed: list[Path]) -> str:
    body = json.dumps({"lora_name": "x", "lora_path": str(path)}).encode()
    return parse_load_lora(body, "/load_lora_adapter", [str(d) for d in allowed]).path


def refused(path: str | Path, allowed: list[Path]) -> str:
    with pytest.raises(APIError) as e:
        load(path, allowed)
    assert e.value.status == 400 and e.value.param == "lora_path", e.value.message
    return e.value.message


def test_inside_loads_and_outside_is_refused(tmp_path):
    root, other = tmp_path / "adapters", tmp_path / "other"
    inside = adapter_dir(root / "sql")
    outside = adapter_dir(other / "chat")
    assert load(inside, [root]) == str(inside.resolve())
    assert load(inside, [other, root]) == str(inside.resolve())  # any of them
    assert load(outside, []) == str(outside.resolve())  # no flag: any readable directory
    assert "outside the directories" in refused(outside, [root])
    assert "outside the directories" in refused(root / ".." / "other" / "chat", [root])
    assert "outside the directories" in refused(other / "nope", [root])  # not "no such directory"
    assert "outside the directories" in refused(tmp_path / "adapters2", [root])  # a sibling sharing the prefix
    assert "no such directory" in refused(root / "nope", [root])


def test_links_out_of_the_allowed_directories_are_refused(tmp_path):
    root, other = tmp_path / "adapters", tmp_path / "other"
    outside = adapter_dir(other / "chat")
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    assert "outside the directories" in refused(root / "link", [root])
    leaky = adapter_dir(root / "leaky")
    (leaky / ADAPTER_FILES[1]).unlink()
    (leaky / ADAPTER_FILES[1]).symlink_to(outside / ADAPTER_FILES[1])
    assert "outside the directories" in refused(leaky, [root])
    # links that stay inside are followed: the allowed directory itself may be reached by a link
    (tmp_path / "via").symlink_to(root, target_is_directory=True)
    inner = adapter_dir(root / "inner")
    assert load(tmp_path / "via" / "inner", [root]) == str(inner.resolve())
    assert load(inner, [tmp_path / "via"]) == str(inner.resolve())


def test_gguf_adapter_files_are_checked_as_directories_are(tmp_path):
    """llama.cpp's adapter is one .gguf file: inside loads, a link to one outside does not,
    another kind of file is refused."""
    root, other = tmp_path / "adapters", tmp_path / "other"
    root.mkdir()
    other.mkdir()
    (root / "sql.gguf").write_bytes(b"GGUF")
    (other / "chat.gguf").write_bytes(b"GGUF")
    assert load(root / "sql.gguf", [root]) == str((root / "sql.gguf").resolve())
    assert "outside the directories" in refused(other / "chat.gguf", [root])
    (root / "link.gguf").symlink_to(other / "chat.gguf")
    assert "outside the directories" in refused(root / "link.gguf", [root])
    (root / "weights.bin").write_bytes(b"")
    assert "nor a .gguf file" in refused(root / "weights.bin", [root])
    assert "no such directory or file" in refused(root / "nope.gguf", [root])
