"""Greedy token ids of the ModelRunner equal transformers' generate on the same weights (the
embedded SmolLM2, fp32, CPU): one request at a time, all as one mixed batch (prefill chunks
and decodes in the same step), and with a shared prefix served from another request's pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from runner_greedy import NEW_TOKENS, PAGE, generate

from gpu.model_runner import ModelRunner, ModelRunnerConfig
from gpu.models.reference import reference_model

PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea and the moon at night.",
    "List three prime numbers greater than twenty, separated by commas, and explain why each is prime.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n',
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old clockmaker "
    "who had spent his whole life repairing the clocks of the townsfolk. One winter morning, a stranger "
    "arrived carrying a clock unlike any he had ever seen, and",
]


pytestmark = pytest.mark.torch_threads(1)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(
        ModelRunnerConfig(quantization="none", page_size=PAGE, max_total_tokens=4096, max_running_requests=8)
    )


@pytest.fixture(scope="module")
def prompts(runner):
    """The PROMPTS, then a last one sharing the last prompt's first two pages (32 tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runner.model_config.model_dir)
    ids = [np.array(tok(p)["input_ids"], np.int32) for p in PROMPTS]
    return ids + [np.concatenate([ids[-1][: 2 * PAGE], ids[2]])]


@pytest.fixture(scope="module")
def expected(runner, prompts):
    model = reference_model(runner.config.model_path)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.from_numpy(ids.astype(np.int64))[None],
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=runner.model_config.eos_token_ids[0],
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def test_one_by_one(runner, prompts, expected):
    for ids, want in zip(prompts[:-1], expected):
        assert generate(runner, [ids], [0], [None]) == [want]


@pytest.fixture(scope="module")
def torch_runner():
    return ModelRunner(
        ModelRunnerConfig(
            quantization="none",
            page_size=PAGE,
            max_total_tokens=4096,
            max_running_requests=8,
            attention_backend="torch",
        )
    )


@pytest.mark.parametrize("backend", ["default", "torch"])
def test_mixed_batch_with_chunked_prefill(backend, runner, torch_runner, prompts, expected):
    # staggered arrivals and chunked prompts: most steps mix prompt chunks with decodes; the
    # default backend (cpu where it builds) and the torch reference
    chosen = runner if backend == "default" else torch_runner
    got = generate(chosen, prompts[:-1], arrive=[0, 0, 1, 2, 2, 3], chunk=[None, 3, None, 7, 16, 11])
    assert got == expected[:-1]


def test_shared_prefix_from_cached_pages(runner, prompts, expected):
    # the last request reuses the previous one's first two pages and computes only its own suffix
    got = generate(runner, prompts[-2:], arrive=[0, 1], chunk=[None, None], prefix_pages=[None, (0, 2)])
    assert got == expected[-2:]
