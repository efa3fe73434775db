"""Shared counters and the two barriers of the ring protocol, chosen once per process.

docs/architecture.md ("Publication order and memory ordering", "Sleeping and waking")
explains the protocol and why each piece is needed; this module only provides the primitives:

- `Counters`: u64 slots at 8-byte aligned offsets of a shared mapping, each loaded
  and stored as ONE aligned 8-byte access (never byte-wise, so never torn).
  "plain": a `memoryview.cast("Q")` item access, which CPython compiles to a
  fixed-size 8-byte memcpy, i.e. a single `mov` (x86-64: TSO gives every store
  release and every load acquire semantics for free). "atomic": libatomic's
  `__atomic_store_8(RELEASE)` / `__atomic_load_8(ACQUIRE)` through ctypes, for
  weakly ordered CPUs (aarch64: `stlr` / `ldar`).
- The store->load barrier of the "announce sleep, then re-check" handshake
  (Dekker: each side stores its own word, then loads the other's; TSO lets that
  load pass the store, so even x86 needs a real barrier here).
  "membarrier": asymmetric; the hot side (the producer publishing records, the
  consumer releasing slots) issues nothing, the side about to sleep calls
  membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED), which runs a full barrier on every
  CPU currently running a registered process. Every process that uses a channel
  registers once (`model()` does it). "fence": both sides call libatomic's
  `atomic_thread_fence(SEQ_CST)` (x86 `mfence`, aarch64 `dmb ish`), used when the
  kernel or a seccomp filter refuses membarrier.

RINGSERVE_IPC_PORTABLE=1 forces "atomic" + "fence" on any CPU, so the code path a
weakly ordered machine takes can be exercised on x86-64 too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import NoReturn

_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283}
_MEMBARRIER_CMD_QUERY = 0
_MEMBARRIER_CMD_GLOBAL_EXPEDITED = 1 << 1
_MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED = 1 << 2
_ATOMIC_ACQUIRE, _ATOMIC_RELEASE, _ATOMIC_SEQ_CST = 2, 3, 5


@dataclass(frozen=True)
class MemoryModel:
    counters: str  # "plain" (x86-64 TSO) | "atomic" (libatomic release/acquire)
    barrier: str  # "membarrier" (asymmetric) | "fence" (seq_cst fence on both sides)
    # hot side, between publishing a counter and reading the peer's sleep flag; None: nothing to do
    publish_barrier: Callable[[], None] | None
    # side about to sleep, between raising its flag and re-checking the counters
    sleep_barrier: Callable[[], None]


@lru_cache(maxsize=1)
def _libatomic() -> ctypes.CDLL:
    path = ctypes.util.find_library("atomic")
    if path is None:
        raise RuntimeError("ipc needs libatomic on this CPU (or without membarrier): install the libatomic1 package")
    lib = ctypes.CDLL(path)
    lib.atomic_thread_fence.argtypes = [ctypes.c_int]
    lib.atomic_thread_fence.restype = None
    lib.__atomic_load_8.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.__atomic_load_8.restype = ctypes.c_uint64
    lib.__atomic_store_8.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    lib.__atomic_store_8.restype = None
    return lib


def _seq_cst_fence() -> Callable[[], None]:
    fence = _libatomic().atomic_thread_fence
    return lambda: fence(_ATOMIC_SEQ_CST)


def _membarrier() -> Callable[[], None] | None:
    """Registers this process for global expedited membarriers; None if unavailable."""
    nr = _SYS_MEMBARRIER.get(platform.machine())
    if nr is None:
        return None
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    syscall.restype = ctypes.c_long
    supported = syscall(nr, _MEMBARRIER_CMD_QUERY, 0, 0)
    needed = _MEMBARRIER_CMD_GLOBAL_EXPEDITED | _MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED
    if supported < 0 or supported & needed != needed:
        return None
    if syscall(nr, _MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0) != 0:
        return None
    # a forked child inherits model()'s cached answer, so it must be registered too
    os.register_at_fork(after_in_child=lambda: syscall(nr, _MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0, 0))

    def barrier() -> None:
        if syscall(nr, _MEMBARRIER_CMD_GLOBAL_EXPEDITED, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "membarrier failed")

    return barrier


@lru_cache(maxsize=1)
def model() -> MemoryModel:
    portable = os.environ.get("RINGSERVE_IPC_PORTABLE", "") == "1"
    counters = "plain" if platform.machine() == "x86_64" and not portable else "atomic"
    heavy = None if portable else _membarrier()
    if heavy is not None:
        return MemoryModel(counters, "membarrier", publish_barrier=None, sleep_barrier=heavy)
    fence = _seq_cst_fence()
    return MemoryModel(counters, "fence", publish_barrier=fence, sleep_barrier=fence)


class Counters:
    """`n` u64 counters at `offset` (8-byte aligned) of a shared mapping.

    `load(i)` / `store(i, value)` are bound once, so a hot-path access is a single
    builtin call (plain) or a single ctypes call (atomic)."""

    def __init__(self, buf: mmap.mmap, offset: int, n: int) -> None:
        if offset % 8:
            raise ValueError(f"counter offset {offset} is not 8-byte aligned")
        self._views: list[memoryview] = []
        self._anchor: ctypes.Array | None = None
        if model().counters == "plain":
            raw = memoryview(buf)[offset : offset + 8 * n]
            words = raw.cast("Q")
            self._views = [words, raw]  # released in this order on close
            self.load: Callable[[int], int] = words.__getitem__
            self.store: Callable[[int, int], None] = words.__setitem__
        else:
            lib = _libatomic()
            self._anchor = (ctypes.c_uint64 * n).from_buffer(buf, offset)
            base = ctypes.addressof(self._anchor)
            # getattr: a dunder name written inside a class body would be name-mangled
            load8, store8 = getattr(lib, "__atomic_load_8"), getattr(lib, "__atomic_store_8")
            self.load = lambda i: load8(base + 8 * i, _ATOMIC_ACQUIRE)
            self.store = lambda i, v: store8(base + 8 * i, v, _ATOMIC_RELEASE)

    def close(self) -> None:
        """Drops the buffer exports so the mapping can be closed."""
        for view in self._views:
            view.release()
        self._views = []
        self._anchor = None
        self.load = self.store = _closed


def _closed(*_: object) -> NoReturn:
    raise ValueError("channel is closed")
