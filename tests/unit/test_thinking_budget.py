"""vLLM's thinking_token_budget in the sampler (gpu/sampling/thinking_budget.py): a row counts
its reasoning tokens and, at its budget, takes the reasoning's end marker token by token; a model
that ends its reasoning itself is left alone; the state rebuilt from an output equals the state
reached step by step (a retracted request resumes the same)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.sampling.sampler import Sampler
from gpu.sampling.thinking_budget import ThinkingBudget
from protocol.sampling_params import InvalidParam, SamplingParams

V = 10
END = (7, 8)  # the reasoning's end marker as token ids
START = (5,)


def run(sampler: Sampler, favourite: list[int], steps: int) -> list[int]:
    """Row 0's tokens over `steps` steps of logits that prefer favourite[step]."""
    out = []
    for step in range(steps):
        logits = torch.zeros(1, V)
        logits[0, favourite[step % len(favourite)]] = 5.0
        out.append(sampler.sample(logits, np.array([0])).tokens.item())
    return out


@pytest.mark.parametrize("budget", [0, 1, 3])
def test_the_end_marker_is_forced_at_the_budget(budget):
    sampler = Sampler(2, V, (9,), torch.device("cpu"))
    params = SamplingParams(temperature=0.0, thinking_budget=budget, think_end_ids=END)
    sampler.set_request(0, params, np.array([1]), np.array([], np.int64))
    assert run(sampler, [2], budget + 4) == [2] * budget + list(END) + [2, 2]


def test_a_start_marker_opens_the_count_and_a_natural_end_closes_it():
    sampler = Sampler(2, V, (9,), torch.device("cpu"))
    params = SamplingParams(temperature=0.0, thinking_budget=2, think_start_ids=START, think_end_ids=END)
    sampler.set_request(0, params, np.array([1]), np.array([], np.int64))
    # before its start marker the row is free; after it, two tokens, then the end is forced
    assert run(sampler, [3, 3, 5, 2, 2, 2, 2], 8) == [3, 3, 5, 2, 2, 7, 8, 3]
    sampler.clear_request(0)
    params = SamplingParams(temperature=0.0, thinking_budget=5, think_end_ids=END)
    sampler.set_request(0, params, np.array([1]), np.array([], np.int64))
    assert run(sampler, [2, 7, 8, 2, 2, 2, 2, 2], 8) == [2, 7, 8, 2, 2, 2, 2, 2]  # ended itself: untouched


def test_the_state_rebuilt_from_an_output_is_the_state_reached():
    walked = ThinkingBudget(3, START, END)
    output = [4, 5, 2, 7, 2, 7, 8, 1]  # 7 alone is no end; the budget forces 7 8 after 2 7 2
    for token in output:
        forced = walked.forced_token()
        assert forced is None or forced == token
        walked.advance(token)
    rebuilt = ThinkingBudget(3, START, END, output)
    assert vars(rebuilt) == vars(walked) and rebuilt.ended and rebuilt.forced_token() is None


def test_markers_are_checked():
    for params in (
        SamplingParams(thinking_budget=2),  # no end marker
        SamplingParams(thinking_budget=2, think_end_ids=(V,)),  # outside the vocabulary
        SamplingParams(thinking_budget=-2, think_end_ids=END),
    ):
        with pytest.raises(InvalidParam):
            params.validate(V)
