"""The request table's per-step bookkeeping: the C version (gpu/kvcache/step_core.c) against the
numpy one, through whole schedulers run side by side on random traffic (chunked prefill,
retraction, stop tokens, min_tokens, aborts), and the C version's argument checks."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_driver import PS, Recording, assert_pages_accounted, make, null_runner

from gpu.kvcache.req_table import ReqTable, step_core
from protocol.records import TOKEN_OUT
from protocol.sampling_params import SamplingParams

native = pytest.mark.skipif(step_core() is None, reason="the C step bookkeeping cannot be built here")


def numpy_table(s) -> None:
    t = s.table
    s.table = ReqTable(t.num_rows, t.max_seq_len, t.page_size, native=False)


def random_params(rng, cycle: np.ndarray) -> SamplingParams:
    stops = tuple(int(x) for x in rng.choice(cycle, rng.integers(0, 3), replace=False))
    max_new = int(rng.integers(1, 100))
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=int(rng.integers(0, max_new + 1)),
        stop_token_ids=stops,
        ignore_eos=bool(rng.integers(0, 2)),
    )


@native
@pytest.mark.parametrize("seed", range(4))
def test_c_and_numpy_bookkeeping_agree_step_by_step(seed):
    rng = np.random.default_rng(seed)
    # a pool of 24 pages for up to 8 requests of up to 180 tokens: retraction happens
    pair = [make(Recording(null_runner(max_total_tokens=24 * PS, rows=8)), chunked_prefill_size=48) for _ in range(2)]
    numpy_table(pair[1])
    cycle = pair[0].runner.cycle
    live: list[tuple[int, int]] = []
    for step in range(3000):
        if step < 300 and rng.random() < 0.5:
            slot = int(rng.integers(0, 64))
            prompt = rng.integers(0, 2000, int(rng.integers(1, 80))).astype(np.int32)
            if rng.random() < 0.3:  # shares a cached prefix
                prompt[: min(32, len(prompt))] = np.arange(min(32, len(prompt)))
            params = random_params(rng, cycle)
            for s in pair:
                s.add_request(0, slot, step + 1, prompt, params)
            live.append((slot, step + 1))
        if live and rng.random() < 0.05:
            slot, gen = live.pop(int(rng.integers(0, len(live))))
            assert pair[0].abort(0, slot, gen) == pair[1].abort(0, slot, gen)
        results = [s.step() for s in pair]
        a, b = (s.runner.steps[-1] if s.runner.steps else None for s in pair)
        assert a == b
        assert results[0].events.tobytes() == results[1].events.tobytes()
        assert results[0].num_sampled == results[1].num_sampled
        for s in pair:
            assert_pages_accounted(s)
        ta, tb = pair[0].table, pair[1].table
        for name in ("ids", "page_table", "length", "kv_len", "num_pages", "active"):
            assert np.array_equal(getattr(ta, name), getattr(tb, name)), name
        if step >= 300 and not pair[0].has_work:
            break
    assert not pair[0].has_work and not pair[1].has_work
    assert pair[0].stats == pair[1].stats and pair[0].stats.retractions > 0


@native
def test_c_bookkeeping_refuses_rows_outside_the_table_and_wrong_element_sizes():
    t = ReqTable(4, 32, PS)
    one = np.ones(1, np.int64)
    with pytest.raises(IndexError):
        t.step_input(np.array([4], np.int64), one)
    with pytest.raises(IndexError):  # past the row's token ids (its known tokens and drafts)
        t.step_input(np.array([0], np.int64), np.array([33], np.int64))
    with pytest.raises(IndexError):
        t.add_pages(np.array([-1], np.int64), np.array([0], np.int32))
    with pytest.raises(IndexError):  # a full row: no room for another token
        t.length[1] = 32
        t.append(np.array([1], np.int64), np.array([5], np.int32), np.zeros(1, np.float32))
    with pytest.raises(ValueError):  # fewer tokens than rows
        t.append(np.array([0, 2], np.int64), np.array([5], np.int32), np.zeros(2, np.float32))
    with pytest.raises(ValueError):  # the C core itself takes rows as int64 only (ReqTable converts)
        t._core.add_pages(np.array([0], np.int32), np.array([0], np.int32))
    assert t.length[0] == 0 and (t.ids == 0).all()  # nothing was written by the refused calls
    t.length[3], t.num_pages[3] = 31, 1
    with pytest.raises(IndexError):  # a row given twice may not write past its end
        t.append(np.array([3, 3], np.int64), np.array([5, 6], np.int32), np.zeros(2, np.float32))
    with pytest.raises(IndexError):
        t.add_pages(np.array([3, 3], np.int64), np.array([7, 8], np.int32))
    assert t.length[3] == 32 and t.num_pages[3] == 2 and t.ids[3, 31] == 5  # the first of each went in
    t.length[3], t.num_pages[3] = 0, 0
    # other dtypes and strided arrays are converted, not refused
    t.length[:2], t.max_len[:2] = 3, 10
    events, finished = t.append(
        np.array([[1, 0]], np.int32)[0, ::-1], np.arange(4, dtype=np.int64)[::2], np.zeros(2, np.float64)
    )
    assert events["token"].tolist() == [0, 2] and t.ids[0, 3] == 0 and t.ids[1, 3] == 2 and finished == []


@pytest.mark.parametrize("c", [pytest.param(True, marks=native), False], ids=["c", "numpy"])
def test_append_fills_each_rows_record_and_reports_finishes_in_order(c):
    t = ReqTable(4, 16, PS, native=c)
    for row, (prompt, max_len, min_len, stops) in enumerate([(3, 5, 3, [7]), (2, 4, 2, []), (1, 16, 4, [7, 9])]):
        t.length[row], t.prompt_len[row], t.max_len[row], t.min_len[row] = prompt, prompt, max_len, min_len
        t.stop_ids[row] = -1
        t.stop_ids[row, : len(stops)] = stops
        t.events[row]["slot"], t.events[row]["prompt_tokens"] = 10 + row, prompt
    rows = np.array([2, 0, 1], np.int64)
    events, finished = t.append(rows, np.array([9, 7, 8], np.int32), np.array([-1.5, -0.5, 0.0], np.float32))
    # row 2 is at length 2 < min_len 4: its stop token 9 does not count; row 0's 7 does
    assert finished == [0]
    assert events["slot"].tolist() == [12, 10, 11] and events["token"].tolist() == [9, 7, 8]
    assert events["finish"].tolist() == [0, 1, 0] and events["logprob"].tolist() == [-1.5, -0.5, 0.0]
    assert events["completion_tokens"].tolist() == [1, 1, 1] and events.dtype == TOKEN_OUT.dtype
    events, finished = t.append(np.array([1], np.int64), np.array([3], np.int32), np.zeros(1, np.float32))
    assert finished == [1] and events["finish"].tolist() == [2]  # length
    assert t.ids[0, 3] == 7 and t.ids[1, 2:4].tolist() == [8, 3] and t.length[:3].tolist() == [4, 4, 2]
