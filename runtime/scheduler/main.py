"""The `ringserve::scheduler` process's entry point: the loop it runs (traced when
RINGSERVE_TRACE_TTFT names a directory), its signals, its start and its end."""

from __future__ import annotations

import logging
import signal

from runtime.config import ServerArgs
from runtime.gc_tuning import settle_heap
from runtime.scheduler.process import SchedulerProcess
from runtime.scheduler.traced import TracedSchedulerProcess
from runtime.ttft_trace import TtftTrace

PROCESS_TITLE = "ringserve::scheduler"


def run_scheduler(
    server_args: ServerArgs, socket_path: str, detokenizer_socket: str, stats_path: str | None = None
) -> None:
    """The process's entry point: loads the model, connects to the detokenizer, listens on
    `socket_path` for HTTP workers and runs the loop until SIGTERM / SIGINT. `stats_path`:
    where to publish EngineStats (runtime/engine_stats.py) every iteration; None publishes none."""
    from setproctitle import setproctitle

    setproctitle(PROCESS_TITLE)
    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s %(levelname)s scheduler: %(message)s")
    trace_dir = TtftTrace.directory()
    if trace_dir is None:
        proc = SchedulerProcess(server_args, socket_path, detokenizer_socket, stats_path)
    else:
        trace = TtftTrace(trace_dir, "scheduler")
        proc = TracedSchedulerProcess(server_args, socket_path, detokenizer_socket, stats_path, trace=trace)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: proc.stop())
    try:
        proc.start()
        settle_heap()
        proc.serve()
    finally:
        proc.close()
