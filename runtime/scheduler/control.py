"""The engine calls the scheduler answers (a CONTROL record in, a REPLY out, both JSON):
SGLang's pause and continue of generation, weights updated from disk, a weight read by name,
LoRA adapters loaded and unloaded.

They run in the scheduler's loop, between steps, so no forward runs meanwhile. Pause modes
(SGLang's): `abort` ends every request in flight (finish_reason "abort"), `retract` puts the
running ones back in the queue (their KV recomputed when generation continues), `in_place`
keeps them as they are; in every mode new requests are taken and wait in the queue until
/continue_generation. A weight update pauses as `retract` does (or `abort` with
abort_all_requests), loads, flushes the prefix cache (its KV is the old weights') and goes on,
unless the engine was paused before it or keep_pause asks it to stay paused. The running
requests' tokens before the update are the old weights', those after it the new weights'.

An unload waits for the requests that named the adapter before it (SGLang's choice): it is
answered by a `Pending` that the scheduler's loop polls after each step, true once none of
them is left (runtime/scheduler/lora.py).
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from protocol.records import PAUSE_MODES
from runtime.scheduler.core import Scheduler

logger = logging.getLogger(__name__)

MAX_WEIGHT_VALUES = 1 << 18  # a get_weights reply's float32 values: about 1.4 MB of base64


def reply(success: bool, message: str, param: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"success": success, "message": message, "param": param, **extra}


class Pending:
    """An engine call answered later: `poll` gives the answer once it is ready, else None."""

    def __init__(self, poll: Callable[[], dict[str, Any] | None]) -> None:
        self.poll = poll


class EngineControl:
    """The scheduler's side of the engine calls; `call` answers one."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def call(self, args: dict[str, Any]) -> dict[str, Any] | Pending:
        op = args.get("op")
        if op == "pause":
            return self.pause(str(args.get("mode", "abort")))
        if op == "continue":
            return self.resume()
        if op == "update_weights":
            return self.update_weights(args)
        if op == "get_weights":
            return self.get_weights(str(args.get("name", "")), int(args.get("truncate_size", 100)))
        if op == "load_lora":
            return self.load_lora(str(args["name"]), str(args["path"]), bool(args.get("pinned", False)))
        if op == "unload_lora":
            return self.unload_lora(str(args["name"]))
        return reply(False, f"unknown engine call {op!r}")

    def pause(self, mode: str) -> dict[str, Any]:
        if mode not in PAUSE_MODES:
            return reply(False, f"mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}", "mode")
        affected = self._hold(mode)
        self.scheduler.paused = mode
        logger.info("generation paused (%s): %d requests %s", mode, affected, "aborted" if mode == "abort" else "held")
        return reply(True, f"Generation paused ({mode}).", mode=mode, num_paused_requests=affected)

    def resume(self) -> dict[str, Any]:
        was = self.scheduler.paused
        self.scheduler.paused = None
        logger.info("generation continues%s", "" if was else " (it was not paused)")
        return reply(True, "Generation continues.")

    def _hold(self, mode: str) -> int:
        s = self.scheduler
        if mode == "abort":
            return s.abort_where(lambda r: True)
        held = s.num_running + len(s.queue)
        if mode == "retract":
            s.retract_all()
        return held

    def update_weights(self, args: dict[str, Any]) -> dict[str, Any]:
        s = self.scheduler
        update = getattr(s.runner, "update_weights_from_disk", None)
        if update is None:
            return reply(False, "the null model has no weights to update", "model_path")
        t0 = time.perf_counter()
        affected = self._hold("abort" if args.get("abort_all_requests") else "retract")
        from gpu.models.weight_update import WeightUpdateError

        if args.get("keep_pause"):
            s.paused = "retract"
        try:
            update(str(args["model_path"]), args.get("load_format"))
        except WeightUpdateError as e:
            logger.warning("weights not updated: %s", e.message)
            return reply(False, e.message, e.param, num_paused_requests=affected)
        freed = s.flush_cache()
        pause_s = time.perf_counter() - t0
        logger.info(
            "weights updated from %s in %.3f s (%d requests paused, %d cached pages dropped)",
            args["model_path"],
            pause_s,
            affected,
            freed,
        )
        return reply(True, "Succeeded to update model weights.", num_paused_requests=affected, pause_s=pause_s)

    def load_lora(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        loras = self.scheduler.loras
        if loras is None:
            return reply(False, "LoRA adapters are not served: start the server with --enable-lora", "lora_name")
        from runtime.scheduler.lora import LoraRefused

        t0 = time.perf_counter()
        try:
            lid = loras.load(name, path, pinned)
        except LoraRefused as e:
            logger.warning("LoRA adapter %r not loaded: %s", name, e.message)
            return reply(False, e.message, e.param)
        logger.info(
            "LoRA adapter %r (id %d%s) loaded from %s in %.3f s",
            name,
            lid,
            ", pinned" if pinned else "",
            path,
            time.perf_counter() - t0,
        )
        return reply(True, f"Success: LoRA adapter '{name}' added successfully.", loaded_adapters=loras.paths())

    def unload_lora(self, name: str) -> dict[str, Any] | Pending:
        s, loras = self.scheduler, self.scheduler.loras
        lid = None if loras is None else loras.unlist(name)
        if loras is None or lid is None:
            return reply(False, f"The lora adapter '{name}' cannot be found.", "lora_name", status=404)
        waiting = s.lora_users(lid)
        logger.info("LoRA adapter %r (id %d) unlisted; %d requests still use it", name, lid, waiting)

        def done() -> dict[str, Any] | None:
            if s.lora_users(lid):
                return None
            loras.forget(lid)
            s.cache.forget_salt(lid)
            logger.info("LoRA adapter %r (id %d) unloaded", name, lid)
            return reply(
                True,
                f"Success: LoRA adapter '{name}' removed successfully.",
                loaded_adapters=loras.paths(),
                waited_requests=waiting,
            )

        answer = done()
        return Pending(done) if answer is None else answer

    def get_weights(self, name: str, truncate_size: int) -> dict[str, Any]:
        weights_by_name = getattr(self.scheduler.runner, "weights_by_name", None)
        if weights_by_name is None:
            return reply(False, "the null model has no weights", "name")
        from gpu.models.weight_update import TooManyValues

        try:
            values = weights_by_name(name, truncate_size, MAX_WEIGHT_VALUES)
        except KeyError:
            return reply(False, f"this model has no weight named {name!r}", "name")
        except TypeError as e:  # gguf-q8's repacked Q4_1 projections keep no rows (gpu/quant/blocks.py)
            return reply(False, f"{name}: {e}; --quantization gguf serves it readable", "name")
        except TooManyValues as e:
            return reply(
                False,
                f"{name}: {e.values} values asked, at most {MAX_WEIGHT_VALUES} are returned: "
                f"truncate_size at most {e.max_rows} for this weight",
                "truncate_size",
            )
        raw = values.numpy().tobytes()
        return reply(True, "", shape=list(values.shape), values=base64.b64encode(raw).decode())


def parse_args(raw: bytes) -> dict[str, Any]:
    value = orjson.loads(raw)
    if not isinstance(value, dict):
        raise ValueError("an engine call's arguments are a JSON object")
    return value
