"""Greedy parity of the scheduler on the real model (SmolLM2-135M, fp32, CPU): batching,
chunked prefill, prefix-cache hits, eviction and retraction never change a request's
tokens from what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_driver import drive

from gpu.model_runner import ModelRunner, ModelRunnerConfig
from protocol.records import Finish
from protocol.sampling_params import SamplingParams
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.core import Scheduler

PS = 16
NEW_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
TEXT = (
    "The history of the city goes back to a small fishing village on the river, where traders "
    "from the north came every spring to exchange furs for salt and grain. Over the centuries the "
    "village grew into a market town, then into a busy port with shipyards, warehouses and a "
    "cathedral whose bells could be heard far out at sea. In the nineteenth century the railway "
    "arrived, factories rose along the canals, and the population doubled within a single "
    "generation. Today the old harbour is a park, the warehouses hold museums and cafes, and "
    "students from all over the world study at its university, which is known for medicine, "
    "engineering and the study of languages. Visitors often climb the tower at sunset to watch "
    "the boats return and the lights come on across the water."
)


def make(runner, **kw) -> Scheduler:
    kw.setdefault("context_length", runner.model_config.context_length)
    kw.setdefault("max_running_requests", runner.config.max_running_requests)
    kw.setdefault("speculative_algorithm", "none")  # the core alone: tests/server/test_speculative.py drafts
    return Scheduler(runner, SchedulerConfig(**kw))


@pytest.fixture(scope="module")
def prompts() -> list[np.ndarray]:
    """64 prompts: 63 windows of 1 to 40 tokens of an English text, the first one 40 long,
    and the last one the first one's first 32 tokens (two pages) followed by another window."""
    from transformers import AutoTokenizer

    from gpu.models.model_files import resolve_model_dir

    ids = AutoTokenizer.from_pretrained(str(resolve_model_dir(None))).encode(TEXT)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(ids) - 40, size=63)
    lengths = rng.integers(1, 41, size=63)
    lengths[0] = 40
    windows = [np.asarray(ids[s : s + n], np.int32) for s, n in zip(starts, lengths)]
    return windows + [np.concatenate([windows[0][:SHARED], windows[1]])]


SHARED = 2 * PS  # tokens the last prompt shares with the first


@pytest.fixture(scope="module")
def big():
    return ModelRunner(
        ModelRunnerConfig(quantization="none", page_size=PS, max_total_tokens=8192, max_running_requests=64)
    )


@pytest.fixture(scope="module")
def small():
    return ModelRunner(
        ModelRunnerConfig(quantization="none", page_size=PS, max_total_tokens=12 * PS, max_running_requests=16)
    )


@pytest.fixture(scope="module")
def alone(big, prompts) -> list[list[int]]:
    """Each prompt run by itself, nothing cached."""
    s = make(big, disable_radix_cache=True, max_running_requests=1)
    outs = []
    for i, p in enumerate(prompts):
        s.add_request(0, i, 1, p, GREEDY)
        outs.append(drive(s)[(0, i, 1)].tokens)
    assert big.pool.num_free == big.pool.num_pages
    return outs


def test_64_requests_together_equal_each_alone(big, prompts, alone):
    s = make(big, chunked_prefill_size=256)  # several steps of mixed prefill chunks and decodes
    for i, p in enumerate(prompts):
        s.add_request(0, i, 1, p, GREEDY)
    outs = drive(s)
    assert [outs[(0, i, 1)].tokens for i in range(64)] == alone
    assert all(outs[(0, i, 1)].finish == Finish.LENGTH for i in range(64))
    assert s.stats.steps < 64 * NEW_TOKENS / 4  # it did batch
    s.flush_cache()
    assert big.pool.num_free == big.pool.num_pages


def test_shared_prefix_is_served_from_cache_and_survives_eviction(small, prompts, alone):
    s = make(small)
    a, b = 0, 63  # b starts with a's first SHARED tokens
    s.add_request(0, 0, 1, prompts[a], GREEDY)
    assert drive(s)[(0, 0, 1)].tokens == alone[a]
    before = s.stats.prefill_tokens
    s.add_request(0, 1, 1, prompts[b], GREEDY)
    o = drive(s)[(0, 1, 1)]
    assert o.counts[2] == SHARED and s.stats.prefill_tokens - before == len(prompts[b]) - SHARED
    assert o.tokens == alone[b]

    # eviction pressure: other requests need the whole pool
    others = sorted(range(1, 63), key=lambda i: -len(prompts[i]))[:6]
    for k, i in enumerate(others):
        s.add_request(0, 10 + k, 1, prompts[i], GREEDY)
    outs = drive(s)
    assert [outs[(0, 10 + k, 1)].tokens for k in range(len(others))] == [alone[i] for i in others]
    assert len(s.cache.match_prefix(prompts[b])[0]) * PS < SHARED  # the shared prefix was evicted
    s.add_request(0, 2, 1, prompts[b], GREEDY)
    assert drive(s)[(0, 2, 1)].tokens == alone[b]
    s.flush_cache()
    assert small.pool.num_free == small.pool.num_pages


def test_too_small_pool_retracts_and_output_is_unchanged(prompts, alone):
    # prompts that end late in a page, in a pool just big enough for their prompts: each
    # needs one more page within its first decodes, and there is none (abort in every state,
    # retracted included, is in test_scheduler.py on the null model)
    chosen = [i for i in range(63) if len(prompts[i]) % PS >= PS - NEW_TOKENS + 2 or len(prompts[i]) % PS == 0]
    pages = sum(-(-len(prompts[i]) // PS) for i in chosen)
    runner = ModelRunner(
        ModelRunnerConfig(quantization="none", page_size=PS, max_total_tokens=pages * PS, max_running_requests=16)
    )
    initial = runner.pool.num_free
    s = make(runner, init_new_token_ratio=0.0, min_new_token_ratio=0.0)  # admit eagerly
    for i in chosen:
        s.add_request(0, i, 1, prompts[i], GREEDY)
    outs = drive(s)
    assert s.stats.retractions > 0
    assert [outs[(0, i, 1)].tokens for i in chosen] == [alone[i] for i in chosen]
    s.flush_cache()
    assert runner.pool.num_free == initial
