"""The cyclic garbage collector in a long-running serving process.

With CPython's defaults, collections are a large part of the HTTP worker's CPU a request;
freezing the start-up heap removes most of it, the larger first generation most of the rest
(measured with gc.callbacks: docs/perf-notes.md).

- A loaded tokenizer (and, in the scheduler, the model and torch) leaves ~10^6 tracked
  objects that never die, and every full collection walks them all again: freezing what
  start-up left behind moves them out of the collector's reach.
- A request's objects (its state, futures, coroutine frames) live for the whole request, so
  with a first generation of 700 allocations each collection finds hundreds of live requests'
  objects, scans them and promotes them, and the older generations scan them again. With
  20000, most of them have died by refcount before any collection sees them. Requests'
  cycles are still collected, a little later."""

from __future__ import annotations

import gc

from runtime.heap_trim import return_freed_memory

YOUNG_THRESHOLD = 20_000  # allocations (net) between first-generation collections; CPython's default is 700


def settle_heap() -> None:
    """Call once, when loading is done and before serving. No collection first: a full
    collection of that heap is slow (it walks every object), and what start-up left as
    garbage is small."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return_freed_memory()  # what loading freed
