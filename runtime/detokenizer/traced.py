"""The detokenizer's loop with first-token stamps, for perf/ttft_breakdown.py: run instead
of the plain loop when RINGSERVE_TRACE_TTFT names a directory (runtime/detokenizer/main.py)."""

from __future__ import annotations

import time

from protocol.records import TokenKind
from runtime.detokenizer.process import DetokenizerProcess
from runtime.ttft_trace import TtftTrace


class TracedDetokenizerProcess(DetokenizerProcess):
    """The loop with first-token stamps (RINGSERVE_TRACE_TTFT, perf/ttft_breakdown.py): when
    the batch holding a request's first TOKEN record was popped, decoded, and pushed to its
    worker. Detokenizer.handle is wrapped on this process's instance only."""

    def __init__(self, *args, trace: TtftTrace) -> None:
        super().__init__(*args)
        self.trace = trace
        self._firsts: list[tuple[int, int, int]] = []  # the handled batch's first tokens
        self._stamps: dict[str, int] = {}

    def load(self, max_open: int) -> None:
        super().load(max_open)
        handle = self.detokenizer.handle

        def traced(batch):
            popped = time.monotonic_ns()
            recs = batch.records
            first = (recs["kind"] == TokenKind.TOKEN) & (recs["completion_tokens"] == 1)
            self._firsts = list(
                zip(recs["worker"][first].tolist(), recs["slot"][first].tolist(), recs["gen"][first].tolist())
            )
            out = handle(batch)
            self._stamps = {"d_pop": popped, "d_decoded": time.monotonic_ns()}
            return out

        self.detokenizer.handle = traced

    def _send(self, records, blob) -> None:
        super()._send(records, blob)
        if self._firsts:
            stamps = {**self._stamps, "d_pushed": time.monotonic_ns()}
            for key in self._firsts:
                self.trace.write(key, stamps)
            self._firsts = []

    def close(self) -> None:
        super().close()
        self.trace.close()
