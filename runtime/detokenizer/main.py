"""The `ringserve::detokenizer` process's entry point: the loop it runs (traced when
RINGSERVE_TRACE_TTFT names a directory), its signals, its start and its end."""

from __future__ import annotations

import logging
import signal

from runtime.config import ServerArgs
from runtime.detokenizer.process import DetokenizerProcess
from runtime.detokenizer.traced import TracedDetokenizerProcess
from runtime.gc_tuning import settle_heap
from runtime.ttft_trace import TtftTrace

PROCESS_TITLE = "ringserve::detokenizer"


def run_detokenizer(
    server_args: ServerArgs, socket_path: str, scheduler_socket: str | None = None, max_open: int = 8192
) -> None:
    """The process's entry point (spawn it). server_args: model_path (for the tokenizer),
    transport, log_level. socket_path: where peers connect (must not exist yet).
    scheduler_socket: where to ask the scheduler to abort the requests of a worker given up on
    (None: it is not asked). max_open: requests the detokenizer keeps open at once (queued
    ones included)."""
    from setproctitle import setproctitle

    setproctitle(PROCESS_TITLE)
    logging.basicConfig(
        level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s detokenizer: %(message)s"
    )
    trace_dir = TtftTrace.directory()
    if trace_dir is None:
        proc = DetokenizerProcess(server_args, socket_path, scheduler_socket)
    else:
        trace = TtftTrace(trace_dir, "detokenizer")
        proc = TracedDetokenizerProcess(server_args, socket_path, scheduler_socket, trace=trace)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proc.stop())
    try:
        proc.load(max_open)
        settle_heap()
        proc.serve()
    finally:
        proc.close()
