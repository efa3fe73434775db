"""Greedy requests run to NEW_TOKENS through a ModelRunner's step() as a scheduler would run
them, with no scheduler: the parity tests' way to batch, chunk and share pages by hand."""

from __future__ import annotations

import numpy as np

from gpu.model_runner import ModelRunner, SeqInput
from protocol.sampling_params import SamplingParams

PAGE = 16
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)


def generate(
    runner: ModelRunner,
    prompts: list[np.ndarray],
    arrive: list[int],
    chunk: list[int | None],
    prefix_pages: list[tuple[int, int] | None] | None = None,
) -> list[list[int]]:
    """Runs requests to NEW_TOKENS (or EOS) the way a scheduler would: request i joins at step
    arrive[i], sends its prompt in chunks of chunk[i] tokens (None: at once) and then decodes.
    prefix_pages[i] = (j, n): request i starts from request j's first n pages, already cached."""
    eos = set(runner.model_config.eos_token_ids)
    n = len(prompts)
    pages: list[np.ndarray | None] = [None] * n
    done_prompt = [0] * n
    outputs: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    step = 0
    try:
        while not all(finished):
            seqs, owners = [], []
            for i in range(n):
                if finished[i] or step < arrive[i]:
                    continue
                if pages[i] is None:
                    runner.set_request(i, GREEDY, prompts[i], np.zeros(0, np.int32))
                    shared = np.zeros(0, np.int32)
                    if prefix_pages and prefix_pages[i]:
                        j, k = prefix_pages[i]
                        shared, done_prompt[i] = pages[j][:k], k * PAGE
                    total = len(prompts[i]) + NEW_TOKENS
                    pages[i] = np.concatenate([shared, runner.pool.alloc(runner.pool.pages_for(total) - len(shared))])
                if done_prompt[i] < len(prompts[i]):
                    start = done_prompt[i]
                    end = len(prompts[i]) if chunk[i] is None else min(start + chunk[i], len(prompts[i]))
                    seqs.append(SeqInput(i, prompts[i][start:end], start, pages[i], end == len(prompts[i])))
                    done_prompt[i] = end
                else:
                    start = len(prompts[i]) + len(outputs[i]) - 1
                    seqs.append(SeqInput(i, np.array(outputs[i][-1:], np.int32), start, pages[i], True))
                if seqs[-1].sample:
                    owners.append(i)
            out = runner.step(seqs)
            for i, tok in zip(owners, out.tokens.tolist()):
                outputs[i].append(tok)
                finished[i] = len(outputs[i]) == NEW_TOKENS or tok in eos
            step += 1
    finally:
        for i, p in enumerate(pages):
            if p is not None:
                shared = prefix_pages[i][1] if prefix_pages and prefix_pages[i] else 0
                runner.pool.free(p[shared:])
    return outputs
