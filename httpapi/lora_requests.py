"""The bodies of SGLang's /load_lora_adapter and /unload_lora_adapter and of vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter: `lora_name` and `lora_path`. Every other
field either server defines is a 400 naming it unless it asks for nothing."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from httpapi.engine_requests import MAX_PATH_CHARS
from httpapi.errors import bad_request
from httpapi.fields import Fields, load_object
from httpapi.request_fields import refuse_unserved
from protocol.lora import ADAPTER_FILES, ADAPTER_NAME, NAME_RULE, is_gguf_adapter

_LOAD_REFUSED = {
    "lora_id": "adapter ids are assigned by the server",
    "load_inplace": "an adapter is not replaced in place: unload it, then load it",
}
_UNLOAD_REFUSED = {
    "lora_id": "adapters are unloaded by lora_name",
    "lora_int_id": "adapters are unloaded by lora_name",
}


@dataclass(frozen=True)
class LoadLora:
    name: str
    path: str  # resolved: absolute, no symbolic link left, a readable directory or .gguf file
    pinned: bool = False  # SGLang's: never evicted from the resident adapters once there


def parse_load_lora(body: bytes, endpoint: str, allowed_dirs: Sequence[str] = ()) -> LoadLora:
    """allowed_dirs: --lora-allowed-dirs (empty: any directory the server can read)."""
    f = Fields(load_object(body))
    name = _name(f)
    raw = f.get_str("lora_path")
    if not raw:
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_path")
    pinned = f.get_bool("pinned", False)
    refuse_unserved(f, _LOAD_REFUSED)
    f.warn_unknown(endpoint)
    return LoadLora(name, resolve_adapter_path(raw, allowed_dirs), pinned)


def parse_unload_lora(body: bytes, endpoint: str) -> str:
    """The adapter's name."""
    f = Fields(load_object(body))
    name = _name(f)
    refuse_unserved(f, _UNLOAD_REFUSED)
    f.warn_unknown(endpoint)
    return name


def _name(f: Fields) -> str:
    name = f.get_str("lora_name")
    if not name:
        raise bad_request("lora_name is required: the name requests will give as `model`", "lora_name")
    if not ADAPTER_NAME.fullmatch(name):
        raise bad_request(f"lora_name must be {NAME_RULE}", "lora_name")
    return name


def resolve_adapter_path(raw: str, allowed_dirs: Sequence[str] = ()) -> str:
    """`raw` as an existing, readable PEFT adapter directory or GGUF adapter file (`.gguf`),
    absolute and with its links resolved (the engine reads what was checked; it then checks the
    adapter's contents), inside one of `allowed_dirs` (theirs resolved too) when any are given;
    a 400 naming lora_path. Whether a path outside them exists is not told."""
    if len(raw) > MAX_PATH_CHARS or any(ord(c) < 32 for c in raw):
        raise bad_request(f"lora_path must be 1 to {MAX_PATH_CHARS} characters without control characters", "lora_path")
    roots = [os.path.realpath(d) for d in allowed_dirs]
    _inside(raw, raw, roots)  # before any look at it: whether a path outside exists is not told
    try:
        path = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, unreadable, or a loop of links
        raise bad_request(f"lora_path {raw!r}: no such directory or file", "lora_path") from None
    if is_gguf_adapter(str(path)) and path.is_file():
        if not os.access(path, os.R_OK):
            raise bad_request(f"lora_path {raw!r}: not readable by the server", "lora_path")
        return str(path)  # resolved: the file itself lies where it was checked to
    if not path.is_dir():
        raise bad_request(
            f"lora_path {raw!r}: neither a directory (a PEFT adapter) nor a .gguf file (llama.cpp's)", "lora_path"
        )
    if not os.access(path, os.R_OK | os.X_OK):
        raise bad_request(f"lora_path {raw!r}: not readable by the server", "lora_path")
    for where in (path, *(path / f for f in ADAPTER_FILES)):  # the files the engine reads: no link out either
        _inside(raw, str(where), roots)
    return str(path)


def _inside(raw: str, where: str, roots: list[str]) -> None:
    """A 400 unless `where`, every link of it that exists followed, lies in one of `roots` (none: anywhere)."""
    real = os.path.realpath(where)
    if roots and not any(os.path.commonpath([real, root]) == root for root in roots):
        raise bad_request(
            f"lora_path {raw!r} is outside the directories this server loads adapters from (--lora-allowed-dirs)",
            "lora_path",
        )
