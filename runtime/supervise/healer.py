"""An HTTP worker's side of supervision: the engine it is attached to watched (its processes'
exits, its heartbeats) and, when that engine is lost, the worker moved onto a new one.

    healer = EngineHealer(args, files, link, client)   # client: the worker process (EngineClient)
    healer.start()                                     # the watchdog and the heartbeat checks
    healer.link                                        # the engine attached now
    await healer.close()

One engine per server: whichever worker loses it first starts the new one (ensure_engine,
under its flock); the others attach to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Protocol

from runtime.config import ServerArgs
from runtime.supervise.files import EngineProcess, ServerFiles
from runtime.supervise.launcher import EngineGaveUp, EngineLink, attach_engine, kill_and_wait
from runtime.supervise.watchdog import EngineWatchdog, stalled_heartbeats

logger = logging.getLogger("ringserve.app")

HEARTBEAT_CHECK_S = 1.0  # the engine's heartbeats are checked this often (at most)
REATTACH_RETRY_S = 1.0  # a failed attach to a new engine is tried again after this (ensure_engine backs off)


class EngineClient(Protocol):
    """What the healer asks of the worker whose engine it watches."""

    def engine_lost(self, message: str) -> None:
        """Every request in flight fails with a 503 saying `message`, and new ones until attach."""

    async def detach(self) -> None:
        """Stops using the lost engine's channels (they stay open until the healer closes them)."""

    def attach(self, link: EngineLink) -> None:
        """Serves requests on the new engine's channels."""

    def engine_gone(self, message: str) -> None:
        """No new engine comes: every request fails with a 503 saying `message` from now on."""


class EngineHealer:
    """Watches the engine a worker is attached to and replaces it when it dies or hangs."""

    def __init__(self, args: ServerArgs, files: ServerFiles, link: EngineLink, client: EngineClient) -> None:
        self.args, self.files, self.link = args, files, link
        self._client = client
        self.watchdog = EngineWatchdog(link.procs, files.server_pid, self._engine_exited)
        self._heartbeats: asyncio.Task | None = None
        self._healing: asyncio.Task | None = None  # attaching to a new engine

    def start(self) -> None:
        self.watchdog.start(asyncio.get_running_loop())
        self._heartbeats = asyncio.create_task(self._watch_heartbeats())

    async def close(self) -> None:
        self.watchdog.close()
        for task in (self._heartbeats, self._healing):
            if task is not None:
                task.cancel()
        if self._healing is not None:
            await asyncio.gather(self._healing, return_exceptions=True)

    def _engine_exited(self, role: str) -> None:
        self._engine_lost(f"The engine's {role} process exited")

    def _engine_lost(self, why: str, hung: EngineProcess | None = None) -> None:
        """Every request in flight fails now, and new ones while a new engine starts (one per
        server: whichever worker comes first starts it, under the flock of ensure_engine).
        `hung`: an engine process to kill first. The old watchdog keeps watching granian's
        main process until the new engine is attached."""
        if self._healing is not None:
            return
        self._client.engine_lost(f"{why}; a new engine is starting, retry shortly.")
        self._healing = asyncio.create_task(self._heal(hung))

    async def _heal(self, hung: EngineProcess | None) -> None:
        cancel = threading.Event()  # a worker that stops meanwhile: the thread's waits end
        try:
            if hung is not None:
                await asyncio.to_thread(kill_and_wait, hung)
            await self._client.detach()
            old = self.link
            claimed = (old.worker, old.worker_lock_fd)
            while True:
                try:
                    link = await asyncio.to_thread(attach_engine, self.args, self.files, claimed, cancel)
                    break
                except EngineGaveUp as e:
                    logger.error("%s", e)
                    self._client.engine_gone(str(e))
                    return  # _healing stays set: this worker does not start the engine again
                except Exception as e:  # it died starting (EngineStartError), a connect failed: the next try
                    logger.error("attaching to a new engine failed (%s): trying again", e)
                    await asyncio.sleep(REATTACH_RETRY_S)
        except asyncio.CancelledError:
            cancel.set()
            raise
        old.close_channels()
        self.watchdog.close()
        for proc in old.procs:  # the old engine is gone (ensure_engine saw to it): no zombie of ours stays
            with contextlib.suppress(ChildProcessError):
                os.waitpid(proc.pid, os.WNOHANG)
        self.link = link
        self.watchdog = EngineWatchdog(link.procs, self.files.server_pid, self._engine_exited)
        self._client.attach(link)
        self.watchdog.start(asyncio.get_running_loop())
        self._healing = None
        logger.warning(
            "HTTP worker %d attached to a new engine: scheduler pid %d, detokenizer pid %d",
            link.worker,
            *(p.pid for p in link.procs),
        )

    async def _watch_heartbeats(self) -> None:
        """A scheduler or detokenizer whose heartbeat is older than --watchdog-timeout is hung:
        it is killed (so that it can be replaced, and so is its peer, which watches it) and
        treated as dead at once."""
        timeout_ns = int(self.args.watchdog_timeout * 1e9)
        while True:
            await asyncio.sleep(min(HEARTBEAT_CHECK_S, self.args.watchdog_timeout / 4))
            if self._healing is not None:
                continue
            link = self.link
            for role, age_s in stalled_heartbeats(
                {"scheduler": link.request_ch, "detokenizer": link.text_ch}, timeout_ns
            ).items():
                proc = next(p for p in link.procs if p.role == role)
                logger.error(
                    "the engine's %s (pid %d) has not beaten for %.1f s (--watchdog-timeout %g): killing it",
                    role,
                    proc.pid,
                    age_s,
                    self.args.watchdog_timeout,
                )
                self._engine_lost(f"The engine's {role} stopped responding for {age_s:.0f} s", hung=proc)
                break
