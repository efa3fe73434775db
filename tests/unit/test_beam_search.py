"""runtime/http_worker/beam_search.py against a toy language model whose next-token logprobs
are a table, and the same search written out by hand (vLLM's EngineClient.beam_search)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import numpy as np
import pytest

from httpapi.logprobs import TokenLogprobs
from httpapi.request_fields import BeamSearch
from protocol.sampling_params import SamplingParams
from runtime.http_worker.beam_search import Beam, beam_search

EOS = 0
PROMPT = [7, 7]
# the next token's probabilities after each last token (the prompt ends with 7)
NEXT = {
    7: {1: 0.5, 2: 0.4, EOS: 0.1},
    1: {EOS: 0.9, 3: 0.1},
    2: {3: 0.6, 4: 0.4},
    3: {EOS: 0.5, 4: 0.5},
    4: {4: 0.7, EOS: 0.3},
    EOS: {4: 0.6, 1: 0.4},  # with ignore_eos a beam goes on past it
}


class ToyEngine:
    """submit() answers each prompt with its last token's table, best first, as top logprobs."""

    def __init__(self) -> None:
        self.model = SimpleNamespace(eos_token_ids=(EOS,))
        self.asked: list[tuple[list[list[int]], SamplingParams]] = []

    async def submit(self, endpoint, prompts, params, n, rids, stream):
        self.asked.append((prompts, params[0]))
        states = []
        for prompt in prompts:
            table = sorted(NEXT[prompt[-1]].items(), key=lambda kv: -kv[1])[: params[0].top_logprobs]
            ids, lps = [t for t, _ in table], [math.log(p) for _, p in table]
            states.append(SimpleNamespace(logprobs=[TokenLogprobs.of([ids[0]], [lps[0]], [ids], [lps])]))
        return states

    @staticmethod
    async def finished(group):
        return group


def search(width: int, max_tokens: int, length_penalty: float = 1.0, **params) -> tuple[list[Beam], ToyEngine]:
    engine = ToyEngine()
    sampling = SamplingParams(max_new_tokens=max_tokens, **params)
    run = beam_search(engine, PROMPT, sampling, BeamSearch(width, length_penalty), "r", engine.finished)
    return asyncio.run(run), engine


def by_hand(width: int, max_tokens: int, length_penalty: float) -> list[tuple[tuple[int, ...], float]]:
    """vLLM's loop: every live beam extended by its 2 * width likeliest tokens, the width best
    kept by score; a beam that picked EOS is done; the width best of done and live returned."""

    def score(tokens: tuple[int, ...], lp: float) -> float:
        return lp / ((len(PROMPT) + len(tokens) - (tokens[-1:] == (EOS,))) ** length_penalty)

    live, done = [((), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, lp in live:
            last = (PROMPT + list(tokens))[-1]
            for t, p in sorted(NEXT[last].items(), key=lambda kv: -kv[1])[: 2 * width]:
                (done if t == EOS else grown).append(((*tokens, t), lp + math.log(p)))
        live = sorted(grown, key=lambda b: score(*b), reverse=True)[:width]
        if not live:
            break
    return sorted(done + live, key=lambda b: score(*b), reverse=True)[:width]


@pytest.mark.parametrize("width", (1, 2, 3))
@pytest.mark.parametrize("max_tokens", (1, 3, 6))
@pytest.mark.parametrize("length_penalty", (0.0, 1.0, 2.0))
def test_beams_are_vllms(width: int, max_tokens: int, length_penalty: float) -> None:
    beams, _ = search(width, max_tokens, length_penalty)
    want = by_hand(width, max_tokens, length_penalty)
    assert [b.tokens for b in beams] == [t for t, _ in want]
    np.testing.assert_allclose([b.cum_logprob for b in beams], [lp for _, lp in want])
    assert all(b.ended == (b.tokens[-1] == EOS) for b in beams)


def test_one_beam_is_greedy() -> None:
    beams, _ = search(1, 6)
    assert [b.tokens for b in beams] == [(1, EOS)]  # 7 -> 1 (0.5) -> EOS (0.9)


def test_ignore_eos_keeps_every_beam_live() -> None:
    beams, _ = search(2, 4, ignore_eos=True)
    assert all(len(b.tokens) == 4 and not b.ended for b in beams)


def test_each_step_asks_one_greedy_token_and_2n_logprobs_per_beam() -> None:
    _, engine = search(3, 3, seed=5)
    assert [len(prompts) for prompts, _ in engine.asked] == [1, 2, 3]  # step 1's EOS beam is done
    for prompts, params in engine.asked:
        assert (params.max_new_tokens, params.logprobs, params.top_logprobs, params.greedy) == (1, True, 6, True)
        assert all(p[: len(PROMPT)] == PROMPT for p in prompts)
