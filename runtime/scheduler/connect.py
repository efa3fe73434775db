"""An HTTP worker's side of the scheduler's socket, apart from the scheduler's loop
(process.py), so that a worker attaching to the engine imports neither the model nor torch."""

from __future__ import annotations

import os

from ipc.peers import connect


def connect_scheduler(socket_path: str, waker, worker: int, timeout: float = 60.0):
    """HTTP worker `worker`'s REQUEST channel (producer side) from the scheduler at
    `socket_path`, and the scheduler's description of the model and KV cache (a dict)."""
    return connect(socket_path, waker, {"worker": worker, "pid": os.getpid()}, timeout)
