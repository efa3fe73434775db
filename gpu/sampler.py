"""Sampling for a whole batch at once with per-request parameters.

Per-row state lives in persistent tensors indexed by the request's row (set once on
admission, updated in place after each step), so a step does a fixed number of batched
ops whatever the batch size; only rows with a seed cost one generator call each.

Order, as vLLM: raw logits -> (logprobs are taken here: the model's own distribution,
vLLM's default "raw_logprobs") -> min_tokens masks EOS/stop ids -> repetition, frequency,
presence penalties -> greedy argmax, or temperature, then top_k / top_p / min_p masks
(all three measured on the same temperature-scaled distribution, kept tokens are their
intersection) and an exponential race (argmax p / q, q ~ Exp(1)), which samples from the
renormalised kept probabilities.

Seeded rows draw q from a generator seeded by (seed, number of tokens generated so far),
so a seeded request gives the same tokens whatever else is in the batch and after being
retracted and resumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

# columns of the per-row float parameter table
_TEMP, _TOP_P, _MIN_P, _REP, _FREQ, _PRES, _TOP_K = range(7)
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) over the 64-bit seed space


@dataclass
class SampleResult:
    tokens: torch.Tensor                 # int64 [S]
    logprobs: torch.Tensor | None        # float32 [S], nan for rows that did not ask; None if none asked
    top_ids: torch.Tensor | None         # int64 [S, K]
    top_logprobs: torch.Tensor | None    # float32 [S, K]


class Sampler:
    def __init__(self, max_rows: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 device: torch.device, random_seed: int = 0) -> None:
        self.V = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        R = max_rows
        # host copies decide which ops a step needs without touching the device
        self.params = np.zeros((R, 7), np.float32)
        self.greedy = np.ones(R, bool)
        self.penalized = np.zeros(R, bool)
        self.uses_top_k_p = np.zeros(R, bool)
        self.uses_min_p = np.zeros(R, bool)
        self.min_tokens = np.zeros(R, np.int64)
        self.num_generated = np.zeros(R, np.int64)
        self.seed = np.full(R, -1, np.int64)
        self.seeded = np.zeros(R, bool)
        self.logprobs = np.zeros(R, bool)
        self.top_logprobs = np.zeros(R, np.int64)
        self._dirty = np.zeros(R, bool)
        # device state
        self.params_t = torch.zeros(R, 7, dtype=torch.float32, device=device)
        self.output_counts = torch.zeros(R, vocab_size, dtype=torch.int32, device=device)  # [R, V]
        self.prompt_seen = torch.zeros(R, vocab_size, dtype=torch.bool, device=device)     # [R, V]
        # ids masked until min_tokens, padded with V (a dummy column past the vocabulary)
        self.stop_ids = torch.full((R, MAX_STOP_TOKEN_IDS + len(eos_token_ids)), vocab_size,
                                   dtype=torch.int64, device=device)
        self.generator = torch.Generator(device=device).manual_seed(random_seed)
        self.row_generator = torch.Generator(device=device)

    def set_request(self, row: int, params: SamplingParams, prompt_ids: np.ndarray,
                    output_ids: np.ndarray) -> None:
        top_k = params.top_k if params.top_k > 0 else self.V
        self.params[row] = (params.temperature, params.top_p, params.min_p, params.repetition_penalty,
                            params.frequency_penalty, params.presence_penalty, min(top_k, self.V))
        self.greedy[row] = params.greedy
        self.penalized[row] = (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
                               or params.presence_penalty != 0.0)
        self.uses_top_k_p[row] = top_k < self.V or params.top_p < 1.0
        self.uses_min_p[row] = params.min_p > 0.0
        self.min_tokens[row] = params.min_new_tokens
        self.num_generated[row] = len(output_ids)
        self.seeded[row] = params.seed is not None
        self.seed[row] = (params.seed or 0) & 0x7FFFFFFFFFFFFFFF
        self.logprobs[row] = params.logprobs
        self.top_logprobs[row] = params.top_logprobs if params.logprobs else 0
        self._dirty[row] = True
        self.output_counts[row].zero_()
        if len(output_ids):
            ids = torch.from_numpy(np.asarray(output_ids, np.int64)).to(self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        self.prompt_seen[row].zero_()
        if self.penalized[row] and len(prompt_ids):
            self.prompt_seen[row, torch.from_numpy(np.asarray(prompt_ids, np.int64)).to(self.device)] = True
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        self.stop_ids[row].fill_(self.V)
        if stops:
            self.stop_ids[row, : len(stops)] = torch.tensor(stops, dtype=torch.int64, device=self.device)

    def clear_request(self, row: int) -> None:
        self.greedy[row], self.penalized[row], self.seeded[row] = True, False, False
        self.logprobs[row], self.top_logprobs[row], self.min_tokens[row] = False, 0, 0

    def sample(self, logits: torch.Tensor, rows: np.ndarray) -> SampleResult:
        """logits: float32 [S, V] of the rows `rows` (int64 [S]); records the chosen tokens."""
        if self._dirty.any():
            dirty = np.flatnonzero(self._dirty)
            self.params_t[torch.from_numpy(dirty).to(self.device)] = \
                torch.from_numpy(self.params[dirty]).to(self.device)
            self._dirty[:] = False
        S = len(rows)
        rows_t = torch.from_numpy(rows).to(self.device)
        want_lp = self.logprobs[rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_lp.any() else None

        masked = np.flatnonzero(self.num_generated[rows] < self.min_tokens[rows])
        if len(masked):
            idx = torch.from_numpy(masked).to(self.device)
            stop = torch.zeros(len(masked), self.V + 1, dtype=torch.bool, device=self.device)
            stop.scatter_(1, self.stop_ids[rows_t[idx]], True)
            logits[idx] = logits[idx].masked_fill(stop[:, : self.V], float("-inf"))

        penalized = np.flatnonzero(self.penalized[rows])
        if len(penalized):
            idx = torch.from_numpy(penalized).to(self.device)
            logits[idx] = self.apply_penalties(logits[idx], rows_t[idx])

        tokens = logits.argmax(dim=-1)
        sampled = np.flatnonzero(~self.greedy[rows])
        if len(sampled):
            idx = torch.from_numpy(sampled).to(self.device)
            tokens[idx] = self._sample_random(logits[idx], rows[sampled], rows_t[idx])

        self.output_counts.index_put_((rows_t, tokens), torch.ones(S, dtype=torch.int32, device=self.device),
                                      accumulate=True)
        self.num_generated[rows] += 1

        if raw_logprobs is None:
            return SampleResult(tokens, None, None, None)
        chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
        chosen = chosen.masked_fill(torch.from_numpy(~want_lp).to(self.device), float("nan"))
        K = int(self.top_logprobs[rows].max())
        if K == 0:
            return SampleResult(tokens, chosen, None, None)
        top_lp, top_ids = raw_logprobs.topk(K, dim=-1)
        return SampleResult(tokens, chosen, top_ids, top_lp)

    def apply_penalties(self, logits: torch.Tensor, rows_t: torch.Tensor) -> torch.Tensor:
        """OpenAI/vLLM: repetition divides positive / multiplies negative logits of tokens seen in
        prompt or output; frequency subtracts penalty * output count, presence penalty * (count > 0)."""
        p = self.params_t[rows_t]                             # [P, 7]
        counts = self.output_counts[rows_t]                   # [P, V]
        in_output = counts > 0
        seen = in_output | self.prompt_seen[rows_t]
        rep = p[:, _REP, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - p[:, _FREQ, None] * counts - p[:, _PRES, None] * in_output

    def filter_probs(self, logits: torch.Tensor, rows: np.ndarray, rows_t: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled probabilities [N, V] with the tokens top_k/top_p/min_p drop set to 0
        (not renormalised)."""
        p = self.params_t[rows_t]
        probs = torch.softmax(logits / p[:, _TEMP, None], dim=-1)
        if self.uses_top_k_p[rows].any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(self.V, device=self.device)[None, :]
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability mass ranked above
            drop_sorted = (rank >= p[:, _TOP_K, None]) | ((before >= p[:, _TOP_P, None]) & (rank > 0))
            drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if self.uses_min_p[rows].any():
            threshold = p[:, _MIN_P, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _sample_random(self, logits: torch.Tensor, rows: np.ndarray, rows_t: torch.Tensor) -> torch.Tensor:
        probs = self.filter_probs(logits, rows, rows_t)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i in np.flatnonzero(self.seeded[rows]):
            row = rows[i]
            step_seed = (int(self.seed[row]) + int(self.num_generated[row]) * _SEED_MIX) & 0x7FFFFFFFFFFFFFFF
            self.row_generator.manual_seed(step_seed)
            q[i].exponential_(generator=self.row_generator)
        q.clamp_(min=torch.finfo(q.dtype).tiny)  # a draw of exactly 0 would make 0 / 0 = nan win
        return (probs / q).argmax(dim=-1)
