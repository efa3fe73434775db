"""Schedulers on the NullModelRunner driven step by step, for the scheduler tests: the runner
(recorded or not), a Scheduler made on it, and a drive loop that checks every step's page
accounting and that nothing comes after a request's end."""

from __future__ import annotations

import numpy as np

from gpu.model_runner import ModelRunnerConfig
from gpu.null_model import NullModelRunner
from protocol.records import NO_TOKEN, Finish
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.core import Scheduler

PS = 16


class Recording:
    """The real runner, with each step's batch written down."""

    def __init__(self, runner) -> None:
        self.runner, self.steps = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self, step):
        self.steps.append(
            list(zip(step.rows.tolist(), step.q_lens.tolist(), step.starts.tolist(), step.sample.tolist()))
        )
        return self.runner.step(step)


def null_runner(max_total_tokens: int, rows: int = 16) -> NullModelRunner:
    return NullModelRunner(
        ModelRunnerConfig(page_size=PS, max_total_tokens=max_total_tokens, max_running_requests=rows)
    )


made: list[Scheduler] = []  # every scheduler make() built, for a leak check after each test


def make(runner, **kw) -> Scheduler:
    kw.setdefault("context_length", runner.model_config.context_length)
    kw.setdefault("max_running_requests", runner.config.max_running_requests)
    kw.setdefault("speculative_algorithm", "none")  # the core alone: tests/server/test_speculative.py drafts
    made.append(Scheduler(runner, SchedulerConfig(**kw)))
    return made[-1]


def assert_pages_accounted(s: Scheduler) -> None:
    """Every page is free, in the radix tree, or owned by exactly one running request."""
    t = s.table
    own = sum(int(t.num_pages[r]) - t.reqs[r].prefix_pages for r in np.flatnonzero(t.active))
    assert s.pool.num_free + s.cache.cached_pages + own == s.pool.num_pages
    assert s.cache.evictable_pages >= 0 and s.cache.protected_pages >= 0


class Out:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish = Finish.NONE
        self.counts = None
        self.records = 0


def drive(s: Scheduler, outs: dict | None = None, max_steps: int = 10_000, on_step=None) -> dict:
    """Steps until nothing is left; returns {(worker, slot, generation): Out}. Checks that a
    request gets nothing after its end and that pages stay accounted for at every step."""
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not s.has_work:
            return outs
        res = s.step()
        for e in res.events:
            o = outs.setdefault((int(e["worker"]), int(e["slot"]), int(e["gen"])), Out())
            assert o.finish == Finish.NONE, "an event after the request ended"
            o.records += 1
            if e["token"] != NO_TOKEN:
                o.tokens.append(int(e["token"]))
            o.finish = Finish(int(e["finish"]))
            o.counts = (int(e["prompt_tokens"]), int(e["completion_tokens"]), int(e["cached_tokens"]))
        assert_pages_accounted(s)
        if on_step:
            on_step(s, res)
    raise AssertionError("the scheduler never ran dry")
