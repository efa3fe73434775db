"""Prompt logprobs (SamplingParams.prompt_logprobs: vLLM's prompt_logprobs, completions' echo with
logprobs, SGLang's input_token_logprobs) against transformers on the same weights (the embedded
SmolLM2, fp32, CPU): each prompt position's logprob is the log-softmax of the model's raw logits
at the position before it, gathered at the prompt's token; the top-k are that row's largest.
Chunked prefill, a prefix in the radix cache, a start position and a retraction must not change
them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.models.reference import reference_model
from protocol.sampling_params import SamplingParams
from runtime.offline import OfflineEngine

ATOL = 1e-3
TOP_K = 3
LONG = (
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old clockmaker "
    "who had spent his whole life repairing the clocks of the townsfolk. One winter morning, a stranger "
    "arrived carrying a clock unlike any he had ever seen, and the clockmaker, curious, opened its case."
)
SHORT = "The capital of France is Paris, and the capital of Italy is"


pytestmark = pytest.mark.torch_threads(2)


@pytest.fixture(scope="module")
def engine():
    # chunks of 16 tokens: the long prompt's positions come over several steps
    return OfflineEngine(
        quantization="none", max_total_tokens=4096, max_running_requests=8, chunked_prefill_size=16, page_size=16
    )


@pytest.fixture(scope="module")
def reference(engine):
    """prompt ids -> transformers' log-softmax [P, V] (row p predicts token p + 1)."""
    model = reference_model(engine.server_args.model_path)
    cache = {}

    def logprobs(ids: list[int]) -> np.ndarray:
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0].float()
            cache[key] = torch.log_softmax(logits, dim=-1).numpy()
        return cache[key]

    return logprobs


def check(out, ref: np.ndarray, start: int, k: int) -> None:
    """`out`'s prompt logprobs from `start` equal the reference's, top-k included."""
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) - start
    for j, lp, top in zip(range(start, len(ids)), out.prompt_logprobs, out.prompt_top_logprobs):
        if j == 0:
            assert lp is None and top is None
            continue
        row = ref[j - 1]
        assert lp == pytest.approx(float(row[ids[j]]), abs=ATOL), j
        assert len(top) == k
        want = np.argsort(-row)[:k]
        got_ids, got_lps = list(top), list(top.values())
        np.testing.assert_allclose(got_lps, row[want], atol=ATOL)
        # ties within the tolerance may swap: each id's own logprob is what it claims
        np.testing.assert_allclose(row[got_ids], got_lps, atol=ATOL)


def test_short_prompt_matches_transformers(engine, reference):
    params = SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=TOP_K)
    (out,) = engine.generate(SHORT, params)
    check(out, reference(out.prompt_token_ids), 0, TOP_K)


def test_chunked_prompt_matches_transformers(engine, reference):
    params = SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=TOP_K)
    (out,) = engine.generate(LONG, params)
    assert len(out.prompt_token_ids) > 3 * 16  # several chunks
    check(out, reference(out.prompt_token_ids), 0, TOP_K)


def test_lm_head_passes_smaller_than_a_chunk_change_nothing(engine, reference, monkeypatch):
    """A vocabulary large enough that one lm_head pass takes fewer positions than a chunk
    holds (Gemma 3's 262k: 128): a chunk's positions over several passes give the same values."""
    import gpu.models.llama

    vocab = engine.scheduler.vocab_size
    monkeypatch.setattr(gpu.models.llama, "PROMPT_LOGITS_BYTES", 5 * 4 * vocab)  # 5 positions a pass
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=TOP_K)
    (out,) = engine.generate(LONG, params)
    check(out, reference(out.prompt_token_ids), 0, TOP_K)


def test_cached_prefix_is_recomputed(engine, reference):
    engine.flush_cache()
    plain = SamplingParams(temperature=0.0, max_new_tokens=1)
    engine.generate(LONG, plain)
    assert engine.generate(LONG, plain)[0].cached_tokens > 0  # the prompt is in the radix cache
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0)
    (out,) = engine.generate(LONG, params)
    assert out.cached_tokens == 0
    check(out, reference(out.prompt_token_ids), 0, 0)
    # from a start position, the pages before it may come from the cache
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=2, prompt_logprobs_start=40)
    (out,) = engine.generate(LONG, params)
    assert out.cached_tokens == 32  # the whole pages before position 39
    check(out, reference(out.prompt_token_ids), 40, 2)


def test_batch_mixes_askers_and_others(engine, reference):
    ask = SamplingParams(temperature=0.0, max_new_tokens=3, prompt_logprobs=1, prompt_logprobs_start=5)
    plain = SamplingParams(temperature=0.0, max_new_tokens=3)
    outs = engine.generate([LONG, SHORT, SHORT + " Rome."], [ask, plain, ask])
    assert outs[1].prompt_logprobs is None
    for out in (outs[0], outs[2]):
        check(out, reference(out.prompt_token_ids), 5, 1)
    # the generated tokens are those of a request that did not ask
    assert outs[0].token_ids == engine.generate(LONG, plain)[0].token_ids


def test_start_past_the_prompt_reports_nothing(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=1, prompt_logprobs_start=1000)
    (out,) = engine.generate(SHORT, params)
    assert out.prompt_logprobs == [] and out.finish_reason == "length"


def test_a_request_retracted_mid_prefill_sends_each_position_once(reference, monkeypatch):
    """A pool of 5 pages: an older request decoding from a 15-token prompt and a 60-token prompt
    owing prompt logprobs (16-token chunks). The older one's pages run out while the prompt is
    still being prefilled, so it is retracted there, owing positions, and resumes later (its
    first pages from the cache): its PROMPT_LOGPROBS records cover [0, 60) once each, in order,
    with the values of a request that ran alone."""
    small = OfflineEngine(
        quantization="none",
        max_total_tokens=5 * 16,
        max_running_requests=4,
        chunked_prefill_size=16,
        page_size=16,
        scheduler_overrides={"init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},  # admit eagerly
    )
    sched = small.scheduler
    records, retracted = [], []
    step, retract = sched.step, sched._retract

    def recording_step():
        res = step()
        if res.prompt_records is not None:
            records.extend((int(r["slot"]), int(r["token"]), int(r["completion_tokens"])) for r in res.prompt_records)
        return res

    def recording_retract(req):
        retracted.append((req.slot, req.prompt_logprobs_next, len(req.prompt)))
        retract(req)

    monkeypatch.setattr(sched, "step", recording_step)
    monkeypatch.setattr(sched, "_retract", recording_retract)
    ids = small.tokenizer.encode(LONG)
    older = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    ask = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outs = small.generate([ids[:15], ids[2:62]], [older, ask])
    assert any(slot == 1 and 0 < owed < P for slot, owed, P in retracted), retracted  # mid-prefill
    mine = [(first, n) for slot, first, n in records if slot == 1]
    assert len(mine) > 1 and mine[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:])), mine  # no gap, no repeat
    assert sum(n for _, n in mine) == 60
    out = outs[1]
    assert out.prompt_token_ids == ids[2:62]
    check(out, reference(out.prompt_token_ids), 0, 2)
