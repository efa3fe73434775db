"""In which order queued requests are admitted: fcfs, or lpm (longest cached prefix first,
which keeps a shared prefix hot and saves prefill work; SGLang's default)."""

from __future__ import annotations

from gpu.kvcache.radix_cache import RadixCache
from runtime.scheduler.req import Req

LPM_MAX_QUEUE = 128  # past this, matching every queued prompt each step costs more than it saves


def order_queue(queue: list[Req], policy: str, cache: RadixCache) -> list[Req]:
    """`queue` is in arrival order; returns a new list, the order to try admitting in."""
    if policy == "fcfs" or cache.disabled or len(queue) < 2 or len(queue) > LPM_MAX_QUEUE:
        return list(queue)
    # a request of a LoRA adapter can reuse only its adapter's pages (its salt)
    matched = {id(r): len(cache.match_prefix(r.fill_ids()[:-1], r.params.lora_id)[0]) for r in queue}
    return sorted(queue, key=lambda r: -matched[id(r)])  # stable: ties stay in arrival order
