"""LoRA adapters by name: `--lora-paths name=path ...` read the same way by every process, so
that the HTTP workers and the scheduler agree on each adapter's id (its place in the list, from
1; 0 is the base model) without the name ever crossing a ring."""

from __future__ import annotations

import re
from collections.abc import Sequence

# a name clients send as `model` (alone, or as `base:name`) and as /generate's lora_path
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


def parse_lora_paths(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """`name=path` (SGLang's and vLLM's form) or a bare `path` (named after its last part) ->
    ((name, path), ...), in order: adapter i + 1 is entry i. ValueError naming the entry for a
    bad name or a name given twice."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            path = item
            name = item.rstrip("/").rsplit("/", 1)[-1]
        if not path:
            raise ValueError(f"--lora-paths {item!r}: no path")
        if not ADAPTER_NAME.fullmatch(name):
            raise ValueError(
                f"--lora-paths {item!r}: an adapter's name is letters, digits and ._/- (at most 128), not {name!r}"
            )
        if any(name == seen for seen, _ in out):
            raise ValueError(f"--lora-paths: the adapter name {name!r} is given twice")
        out.append((name, path))
    return tuple(out)


def adapter_ids(items: Sequence[str]) -> dict[str, int]:
    """name -> the id requests for it carry (SamplingParams.lora_id)."""
    return {name: i + 1 for i, (name, _) in enumerate(parse_lora_paths(items))}
