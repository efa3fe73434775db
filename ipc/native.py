"""The rings' C data path (ipc/ring_core.c), built with the system C compiler on first use.

Where it cannot be built (no compiler, no Python headers) the rings use the Python data
path of ipc/ring.py instead, with a warning: same protocol, same segment, several times
the CPU per push and pop. RINGSERVE_IPC_NATIVE=0 asks for the Python path (tests cover both)."""

from __future__ import annotations

import os
import warnings
from functools import lru_cache
from pathlib import Path

from cbuild import BuildError, build_extension

_SOURCE = Path(__file__).with_name("ring_core.c")


@lru_cache(maxsize=1)
def ring_core() -> type | None:
    """The RingCore type, or None where the Python data path is used."""
    if os.environ.get("RINGSERVE_IPC_NATIVE", "1") == "0":
        return None
    try:
        module = build_extension("ipc.ring_core", _SOURCE, subdir="ipc")
    except (BuildError, ImportError, OSError) as e:
        warnings.warn(
            f"ipc: the C ring data path is unavailable ({e}); the rings use the slower Python one",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return module.RingCore
