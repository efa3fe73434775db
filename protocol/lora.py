"""LoRA adapters by name: `--lora-paths name=path ...` as every process reads it, and the
bounds of the names. The scheduler numbers the adapters (runtime/scheduler/lora.py: those of
--lora-paths 1, 2, ... in order, run-time loads after them; 0 is the base model) and publishes
name -> id for the HTTP workers (runtime/lora_registry.py): the name never crosses a ring."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

# a name clients send as `model` (alone, or as `base:name`) and as /generate's lora_path
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
MAX_ADAPTER_NAME = 128  # bytes: ADAPTER_NAME's longest (ASCII)
MAX_LOADED_LORAS = 4096  # --max-loaded-loras at most: the published table's rows
NAME_RULE = "letters, digits and ._/- (at most 128), starting with a letter or digit"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a PEFT adapter directory's, read by the engine


# the projections an adapter may target, and SGLang's names for groups of them (--lora-target-modules)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_MODULE_GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def lora_target_set(names: Sequence[str]) -> frozenset[str]:
    """--lora-target-modules -> the projections adapters may target (none named, or `all`:
    every one). ValueError naming an unknown module."""
    if not names or "all" in names:
        return frozenset(LORA_MODULES)
    out: set[str] = set()
    for name in names:
        if name not in LORA_MODULES and name not in LORA_MODULE_GROUPS:
            known = ", ".join((*LORA_MODULES, *LORA_MODULE_GROUPS, "all"))
            raise ValueError(f"--lora-target-modules: {name!r} is not a module adapters target ({known})")
        out.update(LORA_MODULE_GROUPS.get(name, (name,)))
    return frozenset(out)


def is_gguf_adapter(path: str) -> bool:
    """Whether `path` names llama.cpp's GGUF LoRA file (gpu/lora_gguf.py) rather than a PEFT
    adapter directory."""
    return path.endswith(".gguf")


def parse_lora_paths(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """((name, path), ...) of parse_lora_entries."""
    return tuple((name, path) for name, path, _ in parse_lora_entries(items))


def parse_lora_entries(items: Sequence[str]) -> tuple[tuple[str, str, bool], ...]:
    """`name=path` (SGLang's and vLLM's form), a bare `path` (named after its last part) or
    SGLang's JSON `{"lora_name", "lora_path", "pinned"}` -> ((name, path, pinned), ...), in
    order: adapter i + 1 is entry i. ValueError naming the entry for a bad entry or name or a
    name given twice."""
    out: list[tuple[str, str, bool]] = []
    for item in items:
        pinned = False
        if item.lstrip().startswith("{"):
            try:
                entry = json.loads(item)
            except ValueError:
                entry = None
            if not isinstance(entry, dict) or set(entry) - {"lora_name", "lora_path", "pinned"}:
                raise ValueError(f'--lora-paths {item!r}: a JSON entry is {{"lora_name", "lora_path", "pinned"}}')
            name, path, pinned = entry.get("lora_name"), entry.get("lora_path"), entry.get("pinned", False)
            if not isinstance(name, str) or not isinstance(path, str) or not isinstance(pinned, bool):
                raise ValueError(f"--lora-paths {item!r}: lora_name and lora_path are strings, pinned a boolean")
        else:
            name, sep, path = item.partition("=")
            if not sep:
                path = item
                name = item.rstrip("/").rsplit("/", 1)[-1]
        if not path:
            raise ValueError(f"--lora-paths {item!r}: no path")
        if not ADAPTER_NAME.fullmatch(name):
            raise ValueError(f"--lora-paths {item!r}: an adapter's name is {NAME_RULE}, not {name!r}")
        if any(name == seen for seen, _, _ in out):
            raise ValueError(f"--lora-paths: the adapter name {name!r} is given twice")
        out.append((name, path, pinned))
    return tuple(out)
