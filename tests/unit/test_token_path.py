"""perf/token_path.py's attribution (a sample's stage, a thread's CPU split over its samples)
and perf/headline.py: the README's headline is what the committed token_path result says."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from perf import headline, token_path

WORKER = "http worker"
SCHEDULER = "ringserve::scheduler"


def frames(*names: str) -> tuple[str, ...]:
    return tuple(names)


def test_a_sample_belongs_to_the_innermost_frame_a_rule_names():
    parse = frames(
        "run (granian/server/mp.py:249)",
        "route (runtime/http_worker/asgi.py:233)",
        "parse_chat_completion (httpapi/chat_request.py:112)",
        "loads (json/decoder.py:3)",
    )
    assert token_path.stage_of(WORKER, parse) == "request parse, sampling fields"
    push = frames(
        "serve (runtime/scheduler/process.py:153)",
        "_send (runtime/scheduler/process.py:212)",
        "NativeRing.push (ipc/ring.py:358)",
    )
    assert token_path.stage_of(SCHEDULER, push) == "rings: push/pop, wakeups"
    draft = frames(
        "serve (runtime/scheduler/process.py:153)",
        "propose (runtime/scheduler/speculative.py:76)",
        "ReqTable.draft (gpu/kvcache/req_table.py:244)",
    )
    assert token_path.stage_of(SCHEDULER, draft) == "drafting (n-gram)"
    assert token_path.stage_of(SCHEDULER, frames("main (x.py:1)")) == "other Python"


def test_a_sample_waiting_in_the_kernel_is_no_stage():
    assert (
        token_path.stage_of(
            SCHEDULER, frames("serve (runtime/scheduler/process.py:1)", "Waker._sleep (ipc/wakeup.py:156)")
        )
        is None
    )
    assert token_path.stage_of(WORKER, ()) is None


def test_each_threads_measured_cpu_is_split_in_proportion_to_its_samples():
    hz = token_path.sb.CLK_TCK
    ticks0 = {(1, 1): ("sched", 0), (1, 2): ("acceptor", 0), (2, 3): ("tokio-rt-worker", 0)}
    ticks1 = {(1, 1): ("sched", 4 * hz), (1, 2): ("acceptor", hz), (2, 3): ("tokio-rt-worker", 2 * hz)}
    ring = ("serve (runtime/scheduler/process.py:1)", "NativeRing.push (ipc/ring.py:358)")
    book = ("serve (runtime/scheduler/process.py:1)", "Scheduler.step (runtime/scheduler/core.py:229)")
    idle = ("serve (runtime/scheduler/process.py:1)", "Waker._sleep (ipc/wakeup.py:156)")
    samples = {1: {1: Counter({ring: 30, book: 90, idle: 500}), 2: Counter({idle: 9})}, 2: {}}
    split = token_path.split_cpu({1: SCHEDULER, 2: WORKER}, ticks0, ticks1, samples)
    assert split[SCHEDULER]["rings: push/pop, wakeups"] == pytest.approx(1.0)
    assert split[SCHEDULER]["bookkeeping: batch, KV pages, radix cache"] == pytest.approx(3.0)
    assert split[SCHEDULER][token_path.UNSAMPLED] == pytest.approx(1.0)  # CPU, yet only idle samples
    assert split[WORKER][token_path.NATIVE_THREADS] == pytest.approx(2.0)


def test_the_readme_headline_is_the_committed_token_path_result():
    result = json.loads(headline.RESULT.read_text())
    assert headline.readme_headline(headline.README.read_text()) == headline.headline(result)
