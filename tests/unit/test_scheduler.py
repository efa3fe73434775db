"""Scheduler bookkeeping on the NullModelRunner (instant tokens, real PagePool): chunked
prefill budgets, row limits, prefix-cache accounting, retraction, abort in every state,
stale addresses, errors, finish reasons, policies. Greedy parity on the real model is in
test_scheduler_greedy.py."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_driver import PS, Recording, assert_pages_accounted, drive, made, make, null_runner

from gpu.null_model import NullModelRunner
from protocol.records import Finish
from protocol.sampling_params import SamplingParams
from runtime.scheduler.core import Scheduler
from runtime.scheduler.req import ReqStatus


@pytest.fixture(autouse=True)
def no_page_leaks():
    """Tests share a runner (and its pool): each must leave every page free once its
    scheduler's cache is flushed."""
    made.clear()
    yield
    for s in made:
        assert not s.has_work
        s.flush_cache()
        assert s.pool.num_free == s.pool.num_pages


def expected(runner: NullModelRunner, n: int) -> list[int]:
    return [int(runner.cycle[i % len(runner.cycle)]) for i in range(n)]


def prompt(n: int, base: int = 100) -> np.ndarray:
    return (np.arange(n) % 1000 + base).astype(np.int32)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def runner():
    return null_runner(max_total_tokens=4096)


def test_chunked_prefill_mixes_with_decodes_within_budget(runner):
    rec = Recording(runner)
    s = make(rec, chunked_prefill_size=32, max_prefill_tokens=48)
    s.add_request(0, 0, 1, prompt(5), GREEDY)
    s.add_request(0, 1, 1, prompt(100, base=3000), GREEDY)
    s.add_request(0, 2, 1, prompt(7, base=5000), GREEDY)
    outs = drive(s)
    assert all(o.tokens == expected(runner, 8) and o.finish == Finish.LENGTH for o in outs.values())
    for step in rec.steps:
        prefill = sum(n for _, n, _, sample in step if n > 1 or not sample)
        assert prefill <= 32
    # the long prompt went through in chunks of 32 while the first request decoded beside it
    long_row = [st for st in rec.steps if any(n == 32 for _, n, _, _ in st)]
    assert len(long_row) >= 2 and any(len(st) > 1 for st in long_row)
    assert outs[(0, 1, 1)].counts == (100, 8, 0)
    assert s.stats.prefill_tokens == 112
    assert s.pool.num_free + s.cache.cached_pages == s.pool.num_pages


def test_max_running_requests_is_a_hard_limit(runner):
    rows = []
    s = make(runner, max_running_requests=3)
    for i in range(10):
        s.add_request(0, i, 1, prompt(3 + i, base=200 * i), GREEDY)
    outs = drive(s, on_step=lambda s, _: rows.append(s.num_running))
    assert max(rows) == 3 and len(outs) == 10
    assert all(o.tokens == expected(runner, 8) for o in outs.values())


def test_prefix_cache_serves_whole_pages_and_counts_them(runner):
    s = make(runner)
    shared = prompt(40, base=7000)
    s.add_request(0, 0, 1, np.concatenate([shared, [1, 2, 3]]), GREEDY)
    drive(s)
    before = s.stats.prefill_tokens
    b = np.concatenate([shared, [4, 5, 6, 7, 8]])
    s.add_request(0, 1, 1, b, GREEDY)
    outs = drive(s)
    assert outs[(0, 1, 1)].counts == (45, 8, 32)  # two whole pages of the shared 40 tokens
    assert s.stats.prefill_tokens - before == 45 - 32
    assert outs[(0, 1, 1)].tokens == expected(runner, 8)
    # the same prompt again: everything but the last (partial-page) tokens is cached
    s.add_request(0, 2, 1, b, GREEDY)
    assert drive(s)[(0, 2, 1)].counts[2] == 32
    freed = s.flush_cache()
    assert freed > 0 and s.cache.cached_pages == 0 and s.pool.num_free == s.pool.num_pages


def test_disabled_radix_cache_shares_nothing(runner):
    s = make(runner, disable_radix_cache=True)
    p = prompt(50, base=900)
    for slot in range(2):
        s.add_request(0, slot, 1, p, GREEDY)
        assert drive(s)[(0, slot, 1)].counts == (50, 8, 0)
    assert s.stats.prefill_tokens == 100 and s.pool.num_free == s.pool.num_pages


def test_lpm_admits_the_longest_cached_prefix_first(runner):
    s = make(runner, max_running_requests=1, schedule_policy="lpm")
    warm = prompt(64, base=11000)
    s.add_request(0, 0, 1, np.append(warm, 1), GREEDY)
    drive(s)
    order = []
    s.add_request(0, 1, 1, prompt(64, base=12000), GREEDY)  # nothing cached, arrived first
    s.add_request(0, 2, 1, np.append(warm, 2), GREEDY)  # 64 tokens cached
    drive(s, on_step=lambda s, res: order.extend(int(e["slot"]) for e in res.events if e["completion_tokens"] == 1))
    assert order == [2, 1]


def test_retraction_when_decode_runs_out_of_pages():
    runner = null_runner(max_total_tokens=20 * PS)
    s = make(runner, init_new_token_ratio=0.0, min_new_token_ratio=0.0)  # admit greedily
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    for i in range(8):
        s.add_request(0, i, 1, prompt(20 + i, base=300 * i), params)
    outs = drive(s)
    assert s.stats.retractions > 0
    assert len(outs) == 8
    for key, o in outs.items():
        assert o.tokens == expected(runner, 40) and o.finish == Finish.LENGTH, key
        assert o.counts[:2] == (20 + key[1], 40)


def test_a_request_alone_in_a_too_small_pool_ends_with_length():
    runner = null_runner(max_total_tokens=4 * PS)
    s = make(runner)
    s.add_request(0, 0, 1, prompt(40), SamplingParams(max_new_tokens=100))
    o = drive(s)[(0, 0, 1)]
    # the KV holds 4 pages; the token sampled after the last of them has no room
    assert o.finish == Finish.LENGTH and len(o.tokens) == 4 * PS - 40 + 1


def held_pages(s: Scheduler, req) -> int:
    return int(s.table.num_pages[req.row]) if req.row >= 0 else 0


def test_abort_in_every_state_frees_pages_at_once():
    runner = null_runner(max_total_tokens=16 * PS, rows=2)
    s = make(
        runner, chunked_prefill_size=32, disable_radix_cache=True, init_new_token_ratio=0.0, min_new_token_ratio=0.0
    )
    total = s.pool.num_pages
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    decoding = s.add_request(0, 0, 1, prompt(30), params)
    s.step()
    s.step()
    assert decoding.status is ReqStatus.RUNNING and s.table.kv_len[decoding.row] >= 30
    prefilling = s.add_request(0, 1, 1, prompt(120, base=2000), params)
    queued = s.add_request(0, 2, 1, prompt(10, base=4000), params)  # rows are full (2)
    s.step()
    assert s.chunked is prefilling and queued.status is ReqStatus.QUEUED
    for req in (queued, prefilling, decoding):
        free, held = s.pool.num_free, held_pages(s, req)
        assert s.abort(req.worker, req.slot, req.generation)
        assert req.status is ReqStatus.FINISHED and s.pool.num_free == free + held
        assert_pages_accounted(s)
    ended = {int(e["slot"]): Finish(int(e["finish"])) for e in s.step().events}
    assert ended == {0: Finish.ABORT, 1: Finish.ABORT, 2: Finish.ABORT}
    assert s.pool.num_free == total and not s.has_work

    # retracted: two requests outgrow the pool; the newer one goes back to the queue
    a = s.add_request(0, 0, 2, prompt(100, base=100), params)
    b = s.add_request(0, 1, 2, prompt(100, base=5000), params)
    while b.status is not ReqStatus.QUEUED or not len(b.output):
        s.step()
        assert a.status is ReqStatus.RUNNING
    assert s.stats.retractions >= 1 and b.row == -1
    assert s.abort(0, 1, 2) and b not in s.queue
    assert s.abort(0, 0, 2)
    events = s.step().events
    assert sorted(events["finish"].tolist()) == [Finish.ABORT] * 2
    assert events[events["slot"] == 1]["completion_tokens"][0] == len(b.output)
    assert s.pool.num_free == total and not s.has_work


def test_stale_addresses_are_ignored(runner):
    s = make(runner)
    r = s.add_request(1, 5, 7, prompt(10), GREEDY)
    assert not s.abort(1, 5, 6) and not s.abort(1, 4, 7) and not s.abort(2, 5, 7)
    assert r.status is ReqStatus.QUEUED
    outs = drive(s)
    assert outs[(1, 5, 7)].tokens == expected(runner, 8)
    assert not s.abort(1, 5, 7)  # finished: a late abort does nothing
    assert not s.has_work
    # a slot reused for a new generation ends the old request (its owner moved on)
    s.add_request(1, 6, 1, prompt(10), GREEDY)
    s.step()
    s.add_request(1, 6, 2, prompt(12), GREEDY)
    outs = drive(s)
    assert outs[(1, 6, 1)].finish == Finish.ABORT
    assert outs[(1, 6, 2)].tokens == expected(runner, 8)


def test_requests_that_cannot_run_end_with_an_error(runner):
    s = make(runner, context_length=64)
    s.add_request(0, 0, 1, prompt(64), GREEDY)  # no room for one generated token
    s.add_request(0, 1, 1, [], GREEDY)
    s.add_request(0, 2, 1, [5, runner.model_config.vocab_size], GREEDY)
    s.add_request(0, 3, 1, [5, -1], GREEDY)
    s.add_request(0, 4, 1, prompt(5), SamplingParams(temperature=-1.0))
    s.add_request(0, 5, 1, prompt(63), SamplingParams(max_new_tokens=100))  # capped by the context
    outs = drive(s)
    for slot in range(5):
        assert outs[(0, slot, 1)].finish == Finish.ERROR and outs[(0, slot, 1)].tokens == []
    assert outs[(0, 5, 1)].finish == Finish.LENGTH and len(outs[(0, 5, 1)].tokens) == 1
    assert s.pool.num_free + s.cache.cached_pages == s.pool.num_pages


def test_stop_token_ids_and_min_tokens(runner):
    s = make(runner)
    cyc = expected(runner, 40)
    stop = cyc[3]
    s.add_request(0, 0, 1, prompt(8), SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)))
    s.add_request(0, 1, 1, prompt(8), SamplingParams(max_new_tokens=30, stop_token_ids=(stop,), min_new_tokens=5))
    outs = drive(s)
    first = cyc.index(stop)
    assert outs[(0, 0, 1)].tokens == cyc[: first + 1] and outs[(0, 0, 1)].finish == Finish.STOP
    # before min_tokens a stop token does not count (the real sampler also masks it)
    hits = [i for i, t in enumerate(cyc[:30]) if t == stop and i >= 5]
    want = cyc[: hits[0] + 1] if hits else cyc[:30]
    assert outs[(0, 1, 1)].tokens == want
    assert outs[(0, 1, 1)].finish == (Finish.STOP if hits else Finish.LENGTH)


def test_open_records_and_one_event_per_running_request_per_step(runner):
    s = make(runner)
    reqs = [s.add_request(0, i, 3, prompt(4 + i, base=50 * i), GREEDY) for i in range(5)]
    res = s.step()
    assert res.opened == reqs
    assert res.num_sampled == 5 and len(np.unique(res.events["slot"])) == 5
    res = s.step()
    assert res.opened == [] and sorted(res.events["slot"].tolist()) == list(range(5))
    assert (res.events["completion_tokens"] == 2).all()
    drive(s)


def test_abort_worker_ends_only_that_workers_requests(runner):
    s = make(runner)
    for worker in (0, 1):
        for slot in range(3):
            s.add_request(worker, slot, 1, prompt(20 + slot, base=100 * worker), GREEDY)
    aborted = []
    outs = drive(s, on_step=lambda s, _: aborted or aborted.append(s.abort_where(lambda r: r.worker == 1)))
    assert aborted == [3]
    assert all(outs[(1, slot, 1)].finish == Finish.ABORT for slot in range(3))
    assert all(outs[(0, slot, 1)].tokens == expected(runner, 8) for slot in range(3))
