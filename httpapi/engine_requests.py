"""SGLang's engine-control bodies: /pause_generation, /continue_generation,
/update_weights_from_disk, /get_weights_by_name. Each field of SGLang's request object is
served, accepted where it changes nothing here, or a 400 naming it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from httpapi.errors import bad_request
from httpapi.fields import Fields, load_object
from httpapi.request_fields import refuse_unserved
from protocol.records import PAUSE_MODES

MAX_PATH_CHARS = 4096  # PATH_MAX
MAX_TRUNCATE_SIZE = 1 << 16  # rows; the engine also bounds the values returned (runtime/scheduler/control.py)
MAX_NAME_CHARS = 256

# SGLang's UpdateWeightFromDiskReqInput fields that ask for what ringserve does not do
_UPDATE_REFUSED = {
    "weight_version": "weight versions are not served",
    "is_async": "only the synchronous update is served",
    "token_step": "trainer step ids are not served",
    "manifest": "tensor manifests are not served",
}


@dataclass(frozen=True)
class UpdateWeights:
    model_path: str  # resolved: absolute, no symbolic link left
    load_format: str | None
    abort_all_requests: bool
    keep_pause: bool


@dataclass(frozen=True)
class GetWeights:
    name: str
    truncate_size: int


def parse_pause(body: bytes) -> str:
    """The pause mode (SGLang's default: abort)."""
    f = Fields(load_object(body) if body.strip() else {})
    mode = f.get_str("mode", "abort", choices=PAUSE_MODES)
    f.get_str("rid")
    f.warn_unknown("/pause_generation")
    return mode


def parse_continue(body: bytes) -> None:
    f = Fields(load_object(body) if body.strip() else {})
    f.get_bool("torch_empty_cache", True)  # no allocator cache to hand back on this engine
    f.get_str("rid")
    f.warn_unknown("/continue_generation")


def parse_update_weights(body: bytes) -> UpdateWeights:
    f = Fields(load_object(body))
    raw = f.get_str("model_path")
    if raw is None:
        raise bad_request("model_path is required: a Hugging Face directory or a .gguf file", "model_path")
    load_format = f.get_str("load_format")
    abort_all = f.get_bool("abort_all_requests", False)
    keep_pause = f.get_bool("keep_pause", False)
    if not f.get_bool("flush_cache", True):
        raise bad_request("flush_cache: the prefix cache holds the old weights' KV, always flushed", "flush_cache")
    f.get_bool("torch_empty_cache", False)  # accepted: nothing to hand back
    f.get_bool("recapture_cuda_graph", False)  # accepted: no CUDA graphs are captured
    f.get_str("rid")
    refuse_unserved(f, _UPDATE_REFUSED)
    f.warn_unknown("/update_weights_from_disk")
    return UpdateWeights(resolve_model_path(raw), load_format, abort_all, keep_pause)


def resolve_model_path(raw: str) -> str:
    """`raw` as an existing model directory or .gguf file, absolute and with its links resolved
    (the engine reads what was checked); a 400 naming model_path otherwise."""
    if not raw or len(raw) > MAX_PATH_CHARS or any(ord(c) < 32 for c in raw):
        raise bad_request(
            f"model_path must be 1 to {MAX_PATH_CHARS} characters without control characters", "model_path"
        )
    try:
        path = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, unreadable, or a loop of links
        raise bad_request(f"model_path {raw!r}: no such file or directory", "model_path") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise bad_request(f"model_path {raw!r}: not a model directory (no config.json)", "model_path")
    elif not (path.is_file() and path.suffix == ".gguf"):
        raise bad_request(f"model_path {raw!r}: neither a model directory nor a .gguf file", "model_path")
    if not os.access(path, os.R_OK):
        raise bad_request(f"model_path {raw!r}: not readable by the server", "model_path")
    return str(path)


def parse_get_weights(body: bytes, query: dict[str, str]) -> GetWeights:
    """From the JSON body, else (a GET without one) from the query string."""
    if body.strip():
        f = Fields(load_object(body))
        name = f.get_str("name")
        truncate = f.get_int("truncate_size", 100)
        f.get_str("rid")
        f.warn_unknown("/get_weights_by_name")
    else:
        name = query.get("name")
        raw = query.get("truncate_size", "100")
        if not raw.isdigit():
            raise bad_request("truncate_size must be an integer", "truncate_size")
        truncate = int(raw)
    if not name or len(name) > MAX_NAME_CHARS:
        raise bad_request(f"name is required: a checkpoint's weight name, at most {MAX_NAME_CHARS} characters", "name")
    if not 1 <= truncate <= MAX_TRUNCATE_SIZE:
        raise bad_request(f"truncate_size must be in [1, {MAX_TRUNCATE_SIZE}]", "truncate_size")
    return GetWeights(name, truncate)
