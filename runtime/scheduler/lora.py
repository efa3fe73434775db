"""The engine's LoRA adapters by name and id (SchedulerLoras): those of --lora-paths at start
(ids 1, 2, ... in their order), those /load_lora_adapter adds and /unload_lora_adapter removes.

Ids are assigned here, in the scheduler, and nowhere else: the table of names and ids is
published for every HTTP worker (runtime/lora_registry.py) before a load or an unload is
answered. An id is not given again while the adapter that had it is registered or draining,
and the next id is the one after the last given (wrapping past the u16 the REQUEST record
carries), so a request whose worker read the table just before an unload cannot reach
another adapter under its old id: the scheduler refuses an id it does not serve.

An unloaded adapter drains: no new request may name it, the requests that already did
(queued or running) finish with it, and then its weights and its prefix-cache root go
(`forget`); the unload is answered then (runtime/scheduler/control.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu.lora import LoraPool
from protocol.lora import parse_lora_paths
from protocol.sampling_params import MAX_LORA_ID
from runtime.lora_registry import LoraRegistry


class LoraRefused(Exception):
    """A load that changes nothing: `param` (lora_name or lora_path) and why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


class SchedulerLoras:
    def __init__(self, pool: LoraPool, lora_paths: Sequence[str], capacity: int) -> None:
        """Registers --lora-paths' adapters (LoraLoadError for one that does not fit the model)."""
        self.pool = pool
        self.capacity = capacity  # --max-loaded-loras: adapters requests may name, at most
        self.ids: dict[str, int] = {}  # name -> id: the adapters requests may name now
        self.served: set[int] = set()  # their ids
        self.draining: set[int] = set()  # unloaded, still held by requests that named them before
        self._last_id = 0
        self.registry: LoraRegistry | None = None  # the published table (the server's scheduler)
        for name, path in parse_lora_paths(lora_paths):
            self._register(name, path)

    def load(self, name: str, path: str) -> int:
        """Registers the adapter at `path` as `name` (read and checked against the model now);
        its id. LoraRefused (nothing changed) for a name in use, a full table, or an adapter
        that does not fit."""
        if name in self.ids:
            raise LoraRefused("lora_name", f"The lora adapter '{name}' has already been loaded.")
        if len(self.ids) >= self.capacity:
            raise LoraRefused(
                "lora_name",
                f"{len(self.ids)} LoRA adapters are loaded, the most --max-loaded-loras allows: unload one first",
            )
        from gpu.lora import LoraLoadError

        try:
            lid = self._register(name, path)
        except LoraLoadError as e:
            raise LoraRefused("lora_path", str(e)) from None
        self.publish()
        return lid

    def _register(self, name: str, path: str) -> int:
        adapter = self.pool.load(name, path)
        lid = self._last_id
        while True:  # the next id no registered or draining adapter has
            lid = lid % MAX_LORA_ID + 1
            if lid not in self.pool.paths:
                break
        self._last_id = lid
        self.pool.register(lid, adapter)
        self.ids[name] = lid
        self.served.add(lid)
        return lid

    def unlist(self, name: str) -> int | None:
        """`name` can no longer be named (published now); its id, to forget once no request
        holds it. None for a name not served."""
        lid = self.ids.pop(name, None)
        if lid is not None:
            self.served.discard(lid)
            self.draining.add(lid)
            self.publish()
        return lid

    def forget(self, lid: int) -> None:
        """An unlisted adapter no request holds any more: its weights dropped."""
        self.draining.discard(lid)
        self.pool.unregister(lid)

    def paths(self) -> dict[str, str]:
        """name -> directory of every adapter requests may name (SGLang's loaded_adapters)."""
        return {name: self.pool.paths[lid][1] for name, lid in self.ids.items()}

    def publish(self) -> None:
        if self.registry is not None:
            self.registry.publish(self.ids)
            self.count()

    def count(self) -> None:
        """The pool's counters, for /metrics."""
        if self.registry is not None:
            p = self.pool
            self.registry.count(len(p.resident), p.loads, p.evictions)
