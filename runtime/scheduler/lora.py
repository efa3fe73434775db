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

The adapters loaded at run time outlive the engine: their names and directories are written
(`engine-<pid>.lora-loads`, beside the published table) before a load or an unload is answered,
and an engine that replaces a dead or hung one registers them again after --lora-paths
(`restore`), so a client's adapter does not turn into a 404 when the supervisor heals the
engine. One that can no longer be read is left out, with a warning in the log.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from gpu.lora import LoraPool
from protocol.lora import parse_lora_entries
from protocol.sampling_params import MAX_LORA_ID
from runtime.lora_registry import LoraRegistry

logger = logging.getLogger("ringserve.scheduler")


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
        self.runtime: dict[str, tuple[str, bool]] = {}  # name -> (directory, pinned) of those loaded at run time
        self.loads_file: Path | None = None  # where they are kept for a replacing engine (restore)
        for name, path, pinned in parse_lora_entries(lora_paths):  # ServerArgs checked the pinned ones' count
            self._register(name, path, pinned)

    def load(self, name: str, path: str, pinned: bool = False) -> int:
        """Registers the adapter at `path` as `name` (read and checked against the model now),
        never evicted once resident if `pinned`; its id. LoraRefused (nothing changed) for a
        name in use, a full table, a pin past the limit, or an adapter that does not fit."""
        if name in self.ids:
            raise LoraRefused("lora_name", f"The lora adapter '{name}' has already been loaded.")
        if len(self.ids) >= self.capacity:
            raise LoraRefused(
                "lora_name",
                f"{len(self.ids)} LoRA adapters are loaded, the most --max-loaded-loras allows: unload one first",
            )
        if pinned and len(self.pool.pinned) >= self.pool.max_resident - 1:
            raise LoraRefused(
                "pinned",
                f"{len(self.pool.pinned)} LoRA adapters are pinned, the most --max-loras-per-batch "
                f"({self.pool.max_resident}) allows: one slot stays for the others",
            )
        from gpu.lora import LoraLoadError

        try:
            lid = self._register(name, path, pinned)
        except LoraLoadError as e:
            raise LoraRefused("lora_path", str(e)) from None
        self.runtime[name] = (path, pinned)
        self._save()
        self.publish()
        return lid

    def restore(self, loads_file: Path) -> None:
        """Keeps the run-time loads in `loads_file` from now on, and first registers again those a
        previous engine of this server kept there (none on a server's first engine)."""
        self.loads_file = loads_file
        try:
            kept = json.loads(loads_file.read_text())
        except FileNotFoundError:
            kept = []
        except (OSError, ValueError) as e:
            logger.warning("%s: cannot read the adapters loaded at run time: %s", loads_file, e)
            kept = []
        for name, path, pinned in kept:
            try:
                self.load(name, path, pinned)
            except LoraRefused as e:
                logger.warning("LoRA adapter %r loaded at run time is not served again: %s", name, e.message)
        self._save()
        if kept:
            logger.info("LoRA adapters loaded at run time served again: %s", ", ".join(self.runtime) or "none")

    def _register(self, name: str, path: str, pinned: bool = False) -> int:
        adapter = self.pool.load(name, path)
        lid = self._last_id
        while True:  # the next id no registered or draining adapter has
            lid = lid % MAX_LORA_ID + 1
            if lid not in self.pool.paths:
                break
        self._last_id = lid
        self.pool.register(lid, adapter, pinned)
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
            if self.runtime.pop(name, None) is not None:
                self._save()
            self.publish()
        return lid

    def _save(self) -> None:
        """The run-time loads, written whole (a new file renamed over the old: never half written)."""
        if self.loads_file is None:
            return
        tmp = self.loads_file.with_name(self.loads_file.name + ".new")
        tmp.write_text(json.dumps([[name, path, pinned] for name, (path, pinned) in self.runtime.items()]))
        os.replace(tmp, self.loads_file)

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
