"""The scheduler's loop with first-token stamps, for perf/ttft_breakdown.py: run instead of
the plain loop when RINGSERVE_TRACE_TTFT names a directory (runtime/scheduler/main.py)."""

from __future__ import annotations

import time

from protocol.records import RequestKind, TokenKind
from runtime.scheduler.process import SchedulerProcess
from runtime.scheduler.step_result import StepResult
from runtime.ttft_trace import TtftTrace

_NEW = int(RequestKind.NEW)


class TracedSchedulerProcess(SchedulerProcess):
    """The loop with first-token stamps (RINGSERVE_TRACE_TTFT, perf/ttft_breakdown.py): when a
    request's NEW record was popped and added, when the step that samples its first token
    entered the runner (admission done), left the forward for the sampler, left the runner,
    and when its TOKEN record was pushed. The runner and its sampler are wrapped on this
    process's instances only."""

    def __init__(self, *args, trace: TtftTrace) -> None:
        super().__init__(*args)
        self.trace = trace
        self._arrived: dict[tuple[int, int, int], dict[str, int]] = {}  # key -> its stamps until its first token
        self._step: dict[str, int] = {}  # the current step's stamps

    def start(self) -> None:
        super().start()
        runner = self.scheduler.runner
        runner.step = self._stamped(runner.step, "forward", "stepped")
        sampler = getattr(runner, "sampler", None)
        if sampler is not None:
            sampler.sample = self._stamped(sampler.sample, "sample", None)

    def _stamped(self, fn, before: str, after: str | None):
        step = self._step

        def call(*args, **kwargs):
            step[before] = time.monotonic_ns()
            out = fn(*args, **kwargs)
            if after is not None:
                step[after] = time.monotonic_ns()
            return out

        return call

    def _handle_requests(self, batch) -> None:
        popped = time.monotonic_ns()
        recs = batch.records
        new = [
            (w, s, g)
            for k, w, s, g in zip(
                recs["kind"].tolist(), recs["worker"].tolist(), recs["slot"].tolist(), recs["gen"].tolist()
            )
            if k == _NEW
        ]
        super()._handle_requests(batch)
        added = time.monotonic_ns()
        for key in new:
            self._arrived[key] = {"s_pop": popped, "s_added": added}

    def _send(self, res: StepResult) -> None:
        sent = time.monotonic_ns()
        super()._send(res)
        pushed = time.monotonic_ns()
        step = dict(self._step)
        self._step.clear()
        if not self._arrived or not len(res.events):
            return
        ev = res.events
        first = (ev["kind"] == TokenKind.TOKEN) & (ev["completion_tokens"] == 1)
        for w, s, g in zip(ev["worker"][first].tolist(), ev["slot"][first].tolist(), ev["gen"][first].tolist()):
            stamps = self._arrived.pop((w, s, g), None)
            if stamps is not None:
                self.trace.write((w, s, g), {**stamps, **step, "s_send": sent, "s_pushed": pushed})

    def close(self) -> None:
        super().close()
        self.trace.close()
