"""A memo bounded by bytes: the caches keyed by what clients send (sampling settings, stop
strings) must not grow with what one client chooses to send. An entry's cost is the bytes it
holds as its owner estimates them (`string_bytes` for its strings); an entry that would take
more than `max_entry_bytes` is not kept (its request simply bypasses the memo)."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

ENTRY_OVERHEAD_BYTES = 1024  # a memo entry's own objects: the key's tuple, the value, the dict slot


def string_bytes(strings: Iterable[str]) -> int:
    """The memory a few strings hold (their objects, not their UTF-8 bytes): O(1) each."""
    return sum(sys.getsizeof(s) for s in strings)


class ByteLRU:
    """Least recently used entries are dropped once the costs of those kept pass `max_bytes`
    or their number passes `max_entries`."""

    def __init__(self, max_bytes: int, max_entries: int = 1024, max_entry_bytes: int | None = None) -> None:
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.max_entry_bytes = max_bytes // 16 if max_entry_bytes is None else max_entry_bytes
        self.bytes = 0  # the costs of the entries kept
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> Any | None:
        """The value kept for `key` (now the most recently used), or None."""
        hit = self._entries.get(key)
        if hit is None:
            return None
        self._entries.move_to_end(key)
        return hit[0]

    def put(self, key: Hashable, value: Any, cost: int) -> bool:
        """Keeps `value` for `key` unless it costs more than max_entry_bytes (then False)."""
        cost += ENTRY_OVERHEAD_BYTES
        if cost > self.max_entry_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (value, cost)
        self.bytes += cost
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
