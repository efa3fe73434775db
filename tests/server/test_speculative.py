"""N-gram speculative decoding (runtime/scheduler/speculative.py): the prompt-lookup drafter
(gpu/kvcache/ngram.py, and the request table's C form of it) against a brute-force reference,
the adaptive policy (draft lengths, back-off, drafting where the measured step costs pay),
the scheduler's verify bookkeeping on the null model (tokens, finish reasons and counts equal
to speculation off, pages accounted, KV lengths, retraction) and on the real model (greedy
tokens and logprobs equal to speculation off)."""

from __future__ import annotations

import numpy as np
import pytest

from gpu.kvcache.ngram import ngram_draft
from gpu.kvcache.req_table import ReqTable, step_core
from gpu.model_runner import ModelRunnerConfig
from gpu.null_model import NullModelRunner
from protocol.records import Finish
from protocol.sampling_params import SamplingParams
from runtime.config import ServerArgs
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.core import Scheduler
from runtime.scheduler.speculative import (
    COST_WEIGHT,
    FREE_BATCH,
    MAX_BATCH,
    MIN_FORWARD_SHARE,
    PRIOR_HITS,
    PRIOR_TRIALS,
    NgramSpeculator,
    NoSpeculation,
    StepCosts,
    make_speculator,
)

PS = 16


def reference_draft(ids: list[int], k: int, min_window: int, max_window: int) -> list[int]:
    """The longest suffix (min..max window) that occurred earlier, its latest occurrence, by brute force."""
    L = len(ids)
    for n in range(min(max_window, L - 1), min_window - 1, -1):
        suffix = ids[L - n :]
        for start in range(L - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                return ids[start + n : min(start + n + k, L)]
    return []


@pytest.mark.parametrize("seed", range(40))
def test_ngram_draft_matches_a_brute_force_reference(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1 + seed % 6, size=int(rng.integers(1, 60))).astype(np.int32)
    k, lo = int(rng.integers(1, 9)), int(rng.integers(1, 4))
    hi = lo + int(rng.integers(0, 6))
    assert ngram_draft(ids, k, lo, hi).tolist() == reference_draft(ids.tolist(), k, lo, hi)


def test_ngram_draft_prefers_the_longest_then_the_latest_match():
    ids = np.array([1, 2, 3, 9, 9, 3, 7, 7, 2, 3], np.int32)
    assert ngram_draft(ids, 3, 1, 4).tolist() == [9, 9, 3]  # "2 3" matches at the start only
    assert ngram_draft(np.array([5, 3, 8, 4, 3], np.int32), 2, 1, 4).tolist() == [8, 4]
    assert ngram_draft(np.array([5, 3, 8, 4, 3], np.int32), 2, 2, 4).tolist() == []  # no 2-token match
    assert ngram_draft(np.array([1, 2, 3], np.int32), 4, 1, 4).tolist() == []


def cycling_table(rows: int, period: int, length: int = 20, max_len: int = 100) -> ReqTable:
    """A request table whose rows' known tokens cycle through `period` ids (filled as admit would)."""
    table: ReqTable = ReqTable(rows, max_len, PS)
    ids = np.tile(np.arange(period, dtype=np.int32), -(-max_len // period))[:max_len]
    table.ids[:] = ids
    table.length[:], table.max_len[:] = length, max_len
    return table


@pytest.mark.parametrize("seed", range(60))
def test_the_tables_c_draft_is_ngram_draft(seed):
    """step_core.c's search against the numpy one, over rows of few distinct ids (many matches)."""
    if step_core() is None:
        pytest.skip("the C step bookkeeping cannot be built here")
    rng = np.random.default_rng(seed)
    c, py = ReqTable(3, 80, PS), ReqTable(3, 80, PS, native=False)
    for row in range(3):
        n = int(rng.integers(0, 81))
        ids = rng.integers(0, 1 + (seed + row) % 5, size=n).astype(np.int32)
        for t in (c, py):
            t.ids[row, :n], t.length[row] = ids, n
        k, lo = int(rng.integers(0, 9)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 14))
        want = ngram_draft(ids, k, lo, hi).tolist()
        assert c.draft(row, k, lo, hi).tolist() == py.draft(row, k, lo, hi).tolist() == want


def test_the_draft_length_adapts_and_whole_rejections_back_off():
    spec = NgramSpeculator(4, max_draft=8, min_window=1, max_window=4)
    spec.admit(0, SamplingParams(temperature=0), constrained=False)
    table = cycling_table(4, 5)
    assert len(spec.propose(table, np.array([0]))[0]) == 5  # the cycle's 5 known tokens follow
    assert len(spec.propose(cycling_table(4, 5, max_len=23), np.array([0]))[0]) == 2  # room for 3 more tokens
    spec.verified(0, 4, 4)
    assert spec.draft_len[0] == 8
    spec.verified(0, 8, 2)
    assert spec.draft_len[0] == 3
    spec.verified(0, 3, 0)
    assert spec.draft_len[0] == 1 and spec.wait[0] == 2
    for _ in range(2):  # waits its turn, then drafts again
        assert spec.propose(table, np.array([0])) == {}
    assert 0 in spec.propose(table, np.array([0]))
    spec.verified(0, 1, 0)
    assert spec.wait[0] == 4
    assert spec.stats.verifies == 4 and spec.stats.draft_tokens == 16 and spec.stats.accepted_tokens == 6


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, repetition_penalty=1.1),
        SamplingParams(temperature=0, frequency_penalty=0.5),
        SamplingParams(temperature=0, min_new_tokens=3),
    ],
)
def test_only_plain_greedy_requests_draft(params):
    spec = NgramSpeculator(2, 4, 1, 4)
    spec.admit(0, params, constrained=False)
    spec.admit(1, SamplingParams(temperature=0), constrained=True)
    assert spec.propose(cycling_table(2, 3), np.array([0, 1])) == {}


def test_step_costs_interpolate_what_was_measured():
    costs = StepCosts(512)
    assert costs.estimate(np.array([1, 100])).tolist() == [1.0, 1.0]  # nothing measured: all alike
    costs.record(513, 0.001)  # past what a drafting step runs: not kept
    assert not costs.seen.any()
    costs.record(8, 0.010)
    costs.record(64, 0.040)
    est = costs.estimate(np.array([1, 8, 36, 64, 400]))
    # below the smallest and past the largest: their costs (a larger step is tried once)
    np.testing.assert_allclose(est, [0.010, 0.010, 0.025, 0.040, 0.040])
    # a running average, after one step's aging: 64 tokens are the cheapest a token, their own floor
    costs.record(64, 0.050)
    assert costs.estimate(np.array([64]))[0] == pytest.approx(0.040 + COST_WEIGHT * (0.050 - 0.040))


def test_step_costs_age_toward_their_tokens_at_the_cheapest_a_token():
    costs = StepCosts(512)
    costs.record(8, 0.010)
    costs.record(64, 0.200)  # measured dear (2.5x 8 tokens' seconds a token)
    for _ in range(300):  # a count measured dear and never run again is tried again in time
        costs.record(8, 0.010)
    assert costs.estimate(np.array([64]))[0] == pytest.approx(64 * 0.010 / 8, rel=0.01)
    # but never below that: a compute-bound step of 128 tokens does not come to look as cheap as
    # the small steps run meanwhile (aged toward their seconds, drafting at 32 decodes did)
    costs = StepCosts(512)
    costs.record(32, 0.032)
    costs.record(128, 0.128)
    for _ in range(300):
        costs.record(2, 0.010)
    np.testing.assert_allclose(costs.estimate(np.array([32, 128])), [0.032, 0.128])


def greedy_speculator(rows: int) -> NgramSpeculator:
    spec = NgramSpeculator(rows, 4, 1, 4)
    for r in range(rows):
        spec.admit(r, SamplingParams(temperature=0), constrained=False)
    return spec


def test_drafts_go_where_the_measured_costs_say_they_pay():
    rows, table = 8, cycling_table(8, 3)
    flat, proportional = greedy_speculator(rows), greedy_speculator(rows)
    for tokens in (8, 16, 24, 40):
        flat.timed(tokens, 0.030, 0.030)  # reading the weights: a token more costs nothing
        proportional.timed(tokens, 0.001 * tokens, 0.001 * tokens)  # compute bound: each token costs the same
    assert {row: len(d) for row, d in flat.propose(table, np.arange(rows)).items()} == dict.fromkeys(range(rows), 3)
    assert proportional.propose(table, np.arange(rows)) == {}  # half of a draft is rejected: no gain
    proportional.hits[:] = 0.0
    proportional.hits[[2, 5]] = proportional.trials[[2, 5]]  # these two accept every draft
    proportional.timed(14, 0.0125, 0.0125)  # 14 tokens a little dearer than 8 (16: as dear a token): 3 drafts each pay
    assert {row: len(d) for row, d in proportional.propose(table, np.arange(rows)).items()} == {2: 3, 5: 3}


def test_nothing_is_drafted_in_a_large_batch():
    rows = MAX_BATCH + 1
    spec = greedy_speculator(rows)
    table = cycling_table(rows, 3)
    assert spec.propose(table, np.arange(rows)) == {}
    assert len(spec.propose(table, np.arange(MAX_BATCH))) == MAX_BATCH


def test_nothing_is_drafted_past_a_small_batch_where_the_host_outweighs_the_forward():
    """The null model's steps: the host's work most of their time; a small batch drafts still."""
    rows, table = 8, cycling_table(8, 3)
    spec = greedy_speculator(rows)
    for tokens in (8, 16, 24, 40):
        spec.timed(tokens, 0.002, 0.0002)  # the forward a tenth of the step: flat, drafting looks free
    assert spec.propose(table, np.arange(rows)) == {}
    assert len(spec.propose(table, np.arange(FREE_BATCH))) == FREE_BATCH
    for _ in range(20):
        spec.timed(8, 0.030, 0.029)  # a real model's: the forward is the step
    assert len(spec.propose(table, np.arange(rows))) == rows


def test_step_costs_are_kept_only_while_they_could_decide_a_draft():
    """Under MIN_FORWARD_SHARE nothing past FREE_BATCH drafts, so the null model's steps keep no
    costs (nor age the requests' counts); a real model's do."""
    rows, table = 8, cycling_table(8, 3)
    spec = greedy_speculator(rows)
    for _ in range(10):
        spec.timed(40, 0.002, 0.0002)
    assert spec.forward_share < MIN_FORWARD_SHARE
    spec.timed(16, 0.002, 0.0002)
    assert not spec.costs.seen[np.searchsorted(spec.costs.edges, 16, "right") - 1]
    spec.hits[:] = 0.0
    assert spec.propose(table, np.arange(rows)) == {}
    assert (spec.hits == 0.0).all()  # not aged back toward the prior in a step that drafts nothing
    while spec.forward_share < MIN_FORWARD_SHARE:
        spec.timed(16, 0.030, 0.029)
    assert spec.costs.seen[np.searchsorted(spec.costs.edges, 16, "right") - 1]


def test_a_small_batch_drafts_what_it_finds():
    spec = greedy_speculator(FREE_BATCH)
    for tokens in (FREE_BATCH, 2 * FREE_BATCH, 9 * FREE_BATCH):
        spec.timed(tokens, 0.001 * tokens, 0.001 * tokens)  # even where each token costs the same
    drafts = spec.propose(cycling_table(FREE_BATCH, 5), np.arange(FREE_BATCH))
    assert {row: len(d) for row, d in drafts.items()} == dict.fromkeys(range(FREE_BATCH), 4)


def one_drafting_row(decodes: int) -> NgramSpeculator:
    """A speculator of `decodes` rows of which only row 0 may draft."""
    spec = greedy_speculator(decodes)
    for row in range(1, decodes):
        spec.release(row)
    return spec


def test_a_draft_is_cut_where_its_tokens_stop_paying():
    """A rate of 1/2: the j-th token is worth 2**-j tokens; costs that grow with the step keep
    the first ones only."""
    spec, table = one_drafting_row(5), cycling_table(5, 5)
    spec.hits[0], spec.trials[0] = 500, 1000
    for tokens, seconds in ((5, 0.0100), (6, 0.0105), (7, 0.0125), (9, 0.0300)):
        spec.timed(tokens, seconds, seconds)
    # expected 5 tokens in 10 ms; 5.5 in 10.5 ms; 5.75 in 12.5 ms; 5.875 in ~21 ms: one is drafted
    assert len(spec.propose(table, np.arange(5))[0]) == 1


def test_the_acceptance_rate_follows_the_verifies_and_ages_back():
    spec, table = one_drafting_row(5), cycling_table(5, 5)
    rate = lambda: spec.accept_rate(np.array([0]))[0]
    assert rate() == PRIOR_HITS / PRIOR_TRIALS
    spec.verified(0, 4, 1)  # the second token rejected: two tried, one accepted
    assert rate() == pytest.approx((PRIOR_HITS + 1) / (PRIOR_TRIALS + 2))
    for tokens in (5, 10):
        spec.timed(tokens, 0.010 * tokens, 0.010 * tokens)  # compute bound: a draft would pay only at a rate of 1
    assert spec.propose(table, np.arange(5)) == {}
    low = rate()
    for _ in range(30):  # steps without a verify: the evidence fades, the rate goes back to the prior
        spec.propose(table, np.arange(5))
    assert low < rate() == pytest.approx(PRIOR_HITS / PRIOR_TRIALS, abs=0.01)


def test_speculation_flags():
    assert isinstance(make_speculator("none", 4, 8, 1, 12), NoSpeculation)
    with pytest.raises(ValueError, match="NGRAM"):
        ServerArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="speculative-num-draft-tokens"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=0)
    with pytest.raises(ValueError, match="max-match-window"):
        ServerArgs(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=4)
    assert ServerArgs().speculative_algorithm == "NGRAM"  # on by default
    args = ServerArgs.from_cli(["--speculative-algorithm", "none", "--speculative-num-draft-tokens", "6"])
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("none", 6)
    config = SchedulerConfig.from_server_args(args, 2048)
    assert config.speculative_algorithm == "none" and config.speculative_num_draft_tokens == 6


# ---- the scheduler on the null model ------------------------------------------------------------


def run_all(s: Scheduler, requests: list[tuple[np.ndarray, SamplingParams]], every: int = 0) -> dict:
    """Every request to its end: slot -> (tokens, finish, completion_tokens of each record).
    every > 0: one request comes every `every` steps (so prefills join drafted decodes)."""
    out = {i: ([], None, []) for i in range(len(requests))}
    waiting = list(enumerate(requests))
    steps = 0
    while waiting or s.has_work:
        while waiting and (not every or steps % every == 0):
            i, (prompt, params) = waiting.pop(0)
            s.add_request(0, i, 1, prompt, params)
            if every:
                break
        res = s.step()
        steps += 1
        for rec in res.events[: res.num_sampled]:
            out[int(rec["slot"])][0].append(int(rec["token"]))
            out[int(rec["slot"])][2].append(int(rec["completion_tokens"]))
        for rec in res.events:
            if rec["finish"] != Finish.NONE:
                tokens, _, counts = out[int(rec["slot"])]
                out[int(rec["slot"])] = (tokens, int(rec["finish"]), counts)
        t = s.table
        active = np.flatnonzero(t.active)
        assert (t.kv_len[active] <= t.length[active]).all()
        own = sum(int(t.num_pages[r]) - t.reqs[r].prefix_pages for r in active)
        assert s.pool.num_free + s.cache.cached_pages + own == s.pool.num_pages
        assert steps < 10_000
    out["steps"] = steps
    return out


def scheduler(algorithm: str, max_total_tokens: int = 4096, **kw) -> Scheduler:
    runner = NullModelRunner(ModelRunnerConfig(page_size=PS, max_total_tokens=max_total_tokens, max_running_requests=8))
    config = SchedulerConfig(
        context_length=runner.model_config.context_length,
        max_running_requests=8,
        speculative_algorithm=algorithm,
        speculative_num_draft_tokens=8,
        **kw,
    )
    return Scheduler(runner, config)


def workload(stop_token: int) -> list[tuple[np.ndarray, SamplingParams]]:
    rng = np.random.default_rng(0)
    greedy = SamplingParams(temperature=0, max_new_tokens=70)
    return [
        (rng.integers(10, 1000, 30).astype(np.int32), greedy),
        (rng.integers(10, 1000, 17).astype(np.int32), SamplingParams(temperature=0, max_new_tokens=33)),
        (rng.integers(10, 1000, 5).astype(np.int32), SamplingParams(temperature=0, max_new_tokens=90, logprobs=True)),
        (rng.integers(10, 1000, 40).astype(np.int32), SamplingParams(temperature=0, stop_token_ids=(stop_token,))),
        (rng.integers(10, 1000, 9).astype(np.int32), SamplingParams(temperature=0.8, max_new_tokens=50, seed=3)),
    ]


@pytest.mark.parametrize("every", [0, 9])
def test_verified_drafts_give_the_tokens_finishes_and_counts_of_speculation_off(every):
    off, on = scheduler("none"), scheduler("NGRAM")
    stop = int(off.runner.cycle[7])
    want, got = run_all(off, workload(stop), every), run_all(on, workload(stop), every)
    assert got.pop("steps") < want.pop("steps")
    assert got == want
    assert want[3][1] == Finish.STOP and want[0][1] == Finish.LENGTH
    stats = on.speculator.stats
    assert stats.verifies > 0 and stats.accepted_tokens > stats.verifies
    assert on.stats.generated_tokens == off.stats.generated_tokens
    for s in (off, on):
        s.flush_cache()
        assert s.pool.num_free == s.pool.num_pages


def test_drafts_take_only_free_pages_and_survive_retraction():
    """A pool too small for every request: decodes retract, drafts shrink to the pages left."""
    eager = dict(max_total_tokens=160, init_new_token_ratio=0.0, min_new_token_ratio=0.0)
    off, on = scheduler("none", **eager), scheduler("NGRAM", **eager)
    requests = [
        (np.arange(20 + i, 40 + i, dtype=np.int32), SamplingParams(temperature=0, max_new_tokens=60)) for i in range(4)
    ]
    want, got = run_all(off, requests), run_all(on, requests)
    want.pop("steps"), got.pop("steps")
    assert got == want
    assert on.stats.retractions > 0 and on.speculator.stats.verifies > 0


# ---- the real model ------------------------------------------------------------------------------

REPEAT = "Copy this code exactly, then stop.\n\n" + "\n".join(
    f"def area_{i}(width, height):\n    return width * height * {i}\n" for i in range(8)
)


def test_the_real_model_gives_the_same_greedy_tokens_and_logprobs():
    from runtime.offline import OfflineEngine

    prompts = [REPEAT, "Write a short poem about the sea."]
    params = SamplingParams(temperature=0, max_new_tokens=40, logprobs=True, top_logprobs=2)
    results = {}
    for algorithm in ("none", "NGRAM"):
        engine = OfflineEngine(speculative_algorithm=algorithm, max_total_tokens=4096, max_running_requests=4)
        alone = [engine.generate([p], params)[0] for p in prompts]  # batch 1: drafts verified
        results[algorithm] = (alone, engine.scheduler.speculator.stats)
    (want, _), (got, stats) = results["none"], results["NGRAM"]
    assert stats.accepted_tokens > 0
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-4)
        assert [list(d) for d in g.top_logprobs] == [list(d) for d in w.top_logprobs]


# ---- behind the server ---------------------------------------------------------------------------


def test_the_server_streams_the_same_greedy_text_and_reports_acceptance(start_server, offline_engine):
    import httpx
    from bad_requests import API_KEY, MODEL

    server = start_server(
        start_server.Server.granian,
        api_key=API_KEY,
        log_level="warning",
        max_total_tokens=8192,
        speculative_algorithm="NGRAM",
    )
    client = server.openai_client(API_KEY, timeout=300)
    want = offline_engine.generate([REPEAT], SamplingParams(temperature=0, max_new_tokens=48))[0]
    stream = client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=48, temperature=0, stream=True)
    chunks = [c.choices[0].text for c in stream if c.choices]
    whole = client.completions.create(model=MODEL, prompt=REPEAT, max_tokens=48, temperature=0)
    assert "".join(chunks) == whole.choices[0].text == want.text
    assert whole.usage.completion_tokens == len(want.token_ids)
    metrics = httpx.get(server.url("/metrics"), timeout=30).text
    values = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert float(values["ringserve_spec_accepted_tokens_total"]) > 0
    assert float(values[f'sglang:spec_accept_length{{model_name="{MODEL}"}}']) > 1.0
    assert 0.0 < float(values[f'sglang:spec_accept_rate{{model_name="{MODEL}"}}']) <= 1.0
