"""Sampling for a whole batch at once with per-request parameters.

Per-row state lives in persistent tensors indexed by the request's row (set once on
admission, updated in place after each step), so a step does a fixed number of batched
ops whatever the batch size; only rows with a seed cost one generator call each.

Order, as vLLM: raw logits -> (logprobs are taken here: the model's own distribution,
vLLM's default "raw_logprobs") -> min_tokens masks EOS/stop ids -> logit_bias is added ->
tokens outside allowed_token_ids go to -inf -> repetition, frequency, presence penalties ->
the grammar's mask (constrained decoding: the tokens it forbids go to -inf) -> a row past its
thinking_token_budget takes its reasoning's end marker's next token -> greedy argmax,
or temperature, then top_k / top_p / min_p masks (all three measured on the same
temperature-scaled distribution, kept tokens are their intersection) and inverse-CDF sampling
from the renormalised kept probabilities (one uniform per row: a sort or an exponential race
over [256, V] costs seconds on a CPU).

Seeded rows draw their uniform from a generator seeded by (seed, tokens generated so far),
so a seeded request gives the same tokens whatever else is in the batch and after being
retracted and resumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.forward_batch import TokenMask
from gpu.sampling.reductions import argmax_rows, log_softmax_parts
from gpu.sampling.thinking_budget import ThinkingBudget
from protocol.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

# columns of the per-row float parameter table
_TEMP, _TOP_P, _MIN_P, _REP, _FREQ, _PRES, _TOP_K = range(7)
_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, step) over the 64-bit seed space
_U64 = 0xFFFFFFFFFFFFFFFF
TOP_CANDIDATES = 1024  # rows with top_k / top_p choose among this many most likely tokens (see filter_probs)


@dataclass
class SampleResult:
    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None  # float32 [S], nan for rows that did not ask; None if none asked
    top_ids: torch.Tensor | None  # int64 [S, K]
    top_logprobs: torch.Tensor | None  # float32 [S, K]


class Sampler:
    def __init__(
        self, max_rows: int, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device, random_seed: int = 0
    ) -> None:
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
        # logprob_token_ids: each pinned row's token ids (int64), reported instead of its top ones
        self.pinned = np.zeros(R, bool)
        self.lp_ids: list[torch.Tensor | None] = [None] * R
        # logit_bias: each biased row's entries, and its (token ids int64, values float32) on the device
        self.bias_len = np.zeros(R, np.int64)
        self.bias: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * R
        # allowed_token_ids: each restricted row's bool [V] of the tokens it may take
        self.restricted = np.zeros(R, bool)
        self.allowed: list[torch.Tensor | None] = [None] * R
        # thinking_token_budget: each budgeted row's count and end marker
        self.budgeted = np.zeros(R, bool)
        self.thinking: list[ThinkingBudget | None] = [None] * R
        self._dirty = np.zeros(R, bool)
        # penalties: each penalized row's tokens (a table of [R, V] counts would hold rows x
        # vocabulary bytes whether or not any row is penalized: 335 MB for Gemma 3's at 256 rows)
        self.history: list[TokenHistory | None] = [None] * R
        # device state
        self.params_t = torch.zeros(R, 7, dtype=torch.float32, device=device)
        # ids masked until min_tokens, padded with V (a dummy column past the vocabulary)
        self.stop_ids = torch.full(
            (R, MAX_STOP_TOKEN_IDS + len(eos_token_ids)), vocab_size, dtype=torch.int64, device=device
        )
        self.generator = torch.Generator(device=device).manual_seed(random_seed)
        self.row_generator = torch.Generator(device=device)

    def set_request(self, row: int, params: SamplingParams, prompt_ids: np.ndarray, output_ids: np.ndarray) -> None:
        self._check_rows(np.array([row]))
        top_k = params.top_k if params.top_k > 0 else self.V
        self.params[row] = (
            params.temperature,
            params.top_p,
            params.min_p,
            params.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
            min(top_k, self.V),
        )
        self.greedy[row] = params.greedy
        self.penalized[row] = params.penalized
        self.uses_top_k_p[row] = top_k < self.V or params.top_p < 1.0
        self.uses_min_p[row] = params.min_p > 0.0
        self.min_tokens[row] = params.min_new_tokens
        self.num_generated[row] = len(output_ids)
        self.seeded[row] = params.seed is not None
        self.seed[row] = params.seed or 0  # any int64: all 2**64 seeds sample apart
        self.logprobs[row] = params.logprobs
        self.top_logprobs[row] = params.top_logprobs if params.logprobs else 0
        self.pinned[row] = bool(params.logprob_token_ids)
        self.lp_ids[row] = None
        if params.logprob_token_ids:
            self.lp_ids[row] = torch.tensor(params.logprob_token_ids, dtype=torch.int64, device=self.device)
        self.bias_len[row] = len(params.logit_bias)
        self.bias[row] = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias[row] = (
                torch.tensor(ids, dtype=torch.int64, device=self.device),
                torch.tensor(values, dtype=torch.float32, device=self.device),
            )
        self.restricted[row] = bool(params.allowed_token_ids)
        self.allowed[row] = None
        if params.allowed_token_ids:
            allowed = torch.zeros(self.V, dtype=torch.bool, device=self.device)
            allowed[torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=self.device)] = True
            self.allowed[row] = allowed
        self.budgeted[row] = params.thinking_budget >= 0
        self.thinking[row] = None
        if params.thinking_budget >= 0:
            self.thinking[row] = ThinkingBudget(
                params.thinking_budget, params.think_start_ids, params.think_end_ids, output_ids.tolist()
            )
        self._dirty[row] = True
        self.history[row] = TokenHistory(prompt_ids, output_ids, self.device) if params.penalized else None
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
        self.stop_ids[row].fill_(self.V)
        if stops:
            self.stop_ids[row, : len(stops)] = torch.tensor(stops, dtype=torch.int64, device=self.device)

    def clear_request(self, row: int) -> None:
        self.greedy[row], self.penalized[row], self.seeded[row] = True, False, False
        self.logprobs[row], self.top_logprobs[row], self.min_tokens[row] = False, 0, 0
        self.pinned[row], self.lp_ids[row] = False, None
        self.bias_len[row], self.bias[row] = 0, None
        self.restricted[row], self.allowed[row] = False, None
        self.budgeted[row], self.thinking[row] = False, None
        self.history[row] = None

    def sample(self, logits: torch.Tensor, rows: np.ndarray, mask: TokenMask | None = None) -> SampleResult:
        """logits: float32 [S, V] of the rows `rows` (int64 [S]), modified in place; records the
        chosen tokens. `mask`: the tokens the constrained ones among them may take."""
        if self._dirty.any():
            dirty = np.flatnonzero(self._dirty)
            self.params_t[self._t(dirty)] = torch.from_numpy(self.params[dirty]).to(self.device)
            self._dirty[:] = False
        self._check_rows(rows)
        S = len(rows)
        rows_t = self._t(rows)
        want_lp = self.logprobs[rows]
        lp_idx = self._t(np.flatnonzero(want_lp))
        K, pinned = int(self.top_logprobs[rows].max()), self.pinned[rows]
        raw_logprobs = parts = None
        if want_lp.any():
            lp_rows = rows[want_lp]
            # greedy rows whose chosen token's logit nothing below changes (the masks only take
            # other tokens away): its logprob is that logit less its row's normaliser
            plain = ~(self.penalized[lp_rows] | self.budgeted[lp_rows] | (self.bias_len[lp_rows] > 0))
            if K <= 1 and not pinned.any() and (plain & self.greedy[lp_rows]).all():
                parts = log_softmax_parts(_take(logits, want_lp, lp_idx))
            else:
                raw_logprobs = torch.log_softmax(_take(logits, want_lp, lp_idx), dim=-1)

        masked = self.num_generated[rows] < self.min_tokens[rows]
        if masked.any():
            idx = self._t(np.flatnonzero(masked))
            stop = torch.zeros(len(idx), self.V + 1, dtype=torch.bool, device=self.device)
            stop.scatter_(1, self.stop_ids[rows_t[idx]], True)
            logits[idx] = logits[idx].masked_fill(stop[:, : self.V], float("-inf"))

        biased = self.bias_len[rows] > 0
        if biased.any():
            self.add_bias(logits, rows, np.flatnonzero(biased))

        restricted = self.restricted[rows]
        if restricted.any():
            pos = np.flatnonzero(restricted)
            allowed = torch.stack([self.allowed[r] for r in rows[pos].tolist()])  # type: ignore[misc]
            idx = self._t(pos)
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))

        penalized = np.flatnonzero(self.penalized[rows])
        if len(penalized):
            idx = self._t(penalized)
            logits[idx] = self.apply_penalties(logits[idx], rows[penalized])

        if mask is not None:
            apply_token_mask(logits, mask)

        budgeted = np.flatnonzero(self.budgeted[rows])
        for i in budgeted.tolist():
            forced = self.thinking[rows[i]].forced_token()  # type: ignore[union-attr]
            if forced is not None:
                logits[i] = float("-inf")
                logits[i, forced] = 0.0

        greedy = self.greedy[rows]
        if greedy.all():
            unchanged = mask is None and not (
                masked.any() or biased.any() or restricted.any() or len(penalized) or len(budgeted)
            )
            # every row's logits as the normalisers' pass saw them: their argmax is the token
            tokens = parts[0] if parts is not None and want_lp.all() and unchanged else argmax_rows(logits)
        else:
            tokens = torch.empty(S, dtype=torch.int64, device=self.device)
            if greedy.any():
                idx = self._t(np.flatnonzero(greedy))
                tokens[idx] = argmax_rows(logits[idx])
            idx = self._t(np.flatnonzero(~greedy))
            tokens[idx] = self._sample_random(_take(logits, ~greedy, idx), rows[~greedy], rows_t[idx])

        self.num_generated[rows] += 1
        if len(penalized):
            for i, token in zip(penalized.tolist(), tokens[self._t(penalized)].tolist()):
                self.history[rows[i]].append(token)  # type: ignore[union-attr]
        if len(budgeted):
            chosen_ids = tokens[self._t(budgeted)].tolist()
            for i, token in zip(budgeted.tolist(), chosen_ids):
                self.thinking[rows[i]].advance(token)  # type: ignore[union-attr]

        if parts is not None:
            return self._plain_logprobs(logits, tokens, lp_idx, K, *parts)
        if raw_logprobs is None:
            return SampleResult(tokens, None, None, None)
        chosen = torch.full((S,), float("nan"), device=self.device)
        chosen[lp_idx] = raw_logprobs.gather(1, tokens[lp_idx, None]).squeeze(1)
        if K == 0:
            return SampleResult(tokens, chosen, None, None)
        top_lp = torch.full((S, K), float("nan"), device=self.device)
        top_ids = torch.zeros((S, K), dtype=torch.int64, device=self.device)
        if K == 1:  # topk copies and partly sorts each row: milliseconds for a vocabulary of 262k
            best = argmax_rows(raw_logprobs)[:, None]
            top_lp[lp_idx], top_ids[lp_idx] = raw_logprobs.gather(1, best), best
        else:
            top_lp[lp_idx], top_ids[lp_idx] = raw_logprobs.topk(K, dim=-1)
        if pinned.any():  # their own ids' logprobs, in the columns their count fills (rows of raw_logprobs: lp_idx's)
            lp_rows = np.cumsum(want_lp) - 1
            for i in np.flatnonzero(pinned).tolist():
                ids = self.lp_ids[rows[i]]
                assert ids is not None
                top_ids[i, : len(ids)] = ids
                top_lp[i, : len(ids)] = raw_logprobs[int(lp_rows[i])].gather(0, ids)
        return SampleResult(tokens, chosen, top_ids, top_lp)

    def _plain_logprobs(
        self,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        lp_idx: torch.Tensor,
        K: int,
        argmax: torch.Tensor,
        top: torch.Tensor,
        log_sum: torch.Tensor,
    ) -> SampleResult:
        """The logprobs of greedy rows' tokens (and K <= 1 alternative) from their rows'
        log_softmax_parts, taken before sampling changed any logit, in log_softmax's order of
        operations: (x - top) - log_sum."""
        S = len(tokens)
        chosen = torch.full((S,), float("nan"), device=self.device)
        chosen[lp_idx] = (logits[lp_idx, tokens[lp_idx]] - top) - log_sum
        if K == 0:
            return SampleResult(tokens, chosen, None, None)
        top_lp = torch.full((S, 1), float("nan"), device=self.device)
        top_ids = torch.zeros((S, 1), dtype=torch.int64, device=self.device)
        top_lp[lp_idx, 0], top_ids[lp_idx, 0] = (top - top) - log_sum, argmax
        return SampleResult(tokens, chosen, top_ids, top_lp)

    def add_bias(self, logits: torch.Tensor, rows: np.ndarray, pos: np.ndarray) -> None:
        """Adds each biased row's logit_bias to its logits, all rows in one scatter-add:
        logits[pos[i]] is the logits row of sampler row rows[pos[i]]."""
        biases = [self.bias[r] for r in rows[pos].tolist()]
        at = self._t(np.repeat(pos, self.bias_len[rows[pos]]))
        ids = torch.cat([b[0] for b in biases])
        values = torch.cat([b[1] for b in biases]).to(logits.dtype)
        logits.index_put_((at, ids), values, accumulate=True)  # a token named twice gets both

    def apply_penalties(self, logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """OpenAI/vLLM: repetition divides positive / multiplies negative logits of tokens seen in
        prompt or output; frequency subtracts penalty * output count, presence penalty * (count > 0).
        logits: [P, V] of the penalized sampler rows `rows` (int64 [P])."""
        histories: list[TokenHistory] = [self.history[r] for r in rows.tolist()]  # type: ignore[misc]
        P = len(rows)
        # the counts and the prompt's tokens of this step's rows only, scattered from their histories
        counts = torch.zeros(P, self.V, dtype=torch.int32, device=self.device)
        outputs = [h.output_ids for h in histories]
        at = self._t(np.repeat(np.arange(P), [len(o) for o in outputs]))
        counts.index_put_(
            (at, self._t(np.concatenate(outputs))), torch.ones(len(at), dtype=torch.int32, device=self.device), True
        )
        in_output = counts > 0
        seen = in_output.clone()
        at = self._t(np.repeat(np.arange(P), [len(h.prompt_ids) for h in histories]))
        seen[at, torch.cat([h.prompt_ids for h in histories])] = True
        p = self.params_t[self._t(rows)]  # [P, 7]
        rep = p[:, _REP, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - p[:, _FREQ, None] * counts - p[:, _PRES, None] * in_output

    def filter_probs(self, logits: torch.Tensor, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The temperature-scaled distribution of rows with the tokens top_k/top_p/min_p drop set
        to 0 (not renormalised): (probs [N, K], their token ids [N, K]), or (probs [N, V], None)
        when no row truncates. Truncating rows keep their TOP_CANDIDATES most likely tokens only,
        which is exact unless a row keeps more (top_p near 1 on a flat distribution with no
        top_k): then the whole vocabulary is sorted."""
        p = self.params_t[self._t(rows)]
        probs = torch.softmax(logits / p[:, _TEMP, None], dim=-1)
        ids = None
        if self.uses_top_k_p[rows].any():
            K = min(self.V, TOP_CANDIDATES)
            cand, ids = probs.topk(K, dim=-1)  # [N, K], descending
            if K < self.V and ((cand.sum(-1) < p[:, _TOP_P]) & (p[:, _TOP_K] > K)).any():
                cand, ids = probs.sort(dim=-1, descending=True)
                K = self.V
            rank = torch.arange(K, device=self.device)[None, :]
            before = cand.cumsum(dim=-1) - cand  # probability mass ranked above
            drop = (rank >= p[:, _TOP_K, None]) | ((before >= p[:, _TOP_P, None]) & (rank > 0))
            probs = cand.masked_fill(drop, 0.0)
        if self.uses_min_p[rows].any():
            threshold = p[:, _MIN_P, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs, ids

    def _sample_random(self, logits: torch.Tensor, rows: np.ndarray, rows_t: torch.Tensor) -> torch.Tensor:
        """Inverse-CDF sampling from the kept probabilities: one uniform draw per row, so a
        seeded row costs one generator call. Rows with top_k/top_p search their candidates in
        rank order, the others the vocabulary in id order: apart, so that a row's token for
        its uniform does not depend on what else is in the batch."""
        u = torch.rand(len(rows), 1, generator=self.generator, device=self.device)
        for i in np.flatnonzero(self.seeded[rows]):
            row = rows[i]
            self.row_generator.manual_seed(_row_seed(int(self.seed[row]), int(self.num_generated[row])))
            u[i] = torch.rand(1, generator=self.row_generator, device=self.device)
        ranked = self.uses_top_k_p[rows]
        if ranked.all() or not ranked.any():
            return self._inverse_cdf(logits, rows, u)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=self.device)
        for part in (ranked, ~ranked):
            idx = self._t(np.flatnonzero(part))
            tokens[idx] = self._inverse_cdf(logits[idx], rows[part], u[idx])
        return tokens

    def _inverse_cdf(self, logits: torch.Tensor, rows: np.ndarray, u: torch.Tensor) -> torch.Tensor:
        """The kept token whose CDF interval holds u (float32 [N, 1]) of each row."""
        probs, ids = self.filter_probs(logits, rows)
        cdf = probs.cumsum(dim=-1)  # non-decreasing, so searchable
        total = cdf[:, -1:]
        # strictly below the total, so the first cdf entry above u is a kept token
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        picked = torch.searchsorted(cdf, target, right=True)  # [N, 1]
        # a row whose distribution is not one (inf or NaN logits from the model) finds no token
        # (picked == its width): it takes its most likely kept token rather than an id past the end
        broken = ~(total > 0) | ~torch.isfinite(total)
        if broken.any():
            picked = torch.where(broken, probs.nan_to_num(nan=-1.0).argmax(dim=-1, keepdim=True), picked)
        return picked.squeeze(1) if ids is None else ids.gather(1, picked).squeeze(1)

    def _check_rows(self, rows: np.ndarray) -> None:
        R = len(self.greedy)
        if len(rows) and (rows.min() < 0 or rows.max() >= R):
            raise ValueError(
                f"sampler row {rows[(rows < 0) | (rows >= R)][0]} is outside [0, {R}) (max_running_requests)"
            )

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)


class TokenHistory:
    """A penalized request's tokens: its prompt's distinct ids (on the device) and the ids it
    generated so far (on the host, appended each step), from which a step counts them."""

    def __init__(self, prompt_ids: np.ndarray, output_ids: np.ndarray, device: torch.device) -> None:
        self.prompt_ids = torch.from_numpy(np.unique(np.asarray(prompt_ids, np.int64))).to(device)
        self._output = np.zeros(max(16, 2 * len(output_ids)), np.int64)
        self._output[: len(output_ids)] = output_ids
        self._n = len(output_ids)

    @property
    def output_ids(self) -> np.ndarray:
        return self._output[: self._n]

    def append(self, token: int) -> None:
        if self._n == len(self._output):  # doubling: amortised O(1) a token
            self._output = np.concatenate([self._output, np.zeros_like(self._output)])
        self._output[self._n] = token
        self._n += 1


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Sets the logits of the tokens `mask` forbids to -inf, for its rows only, in one call
    (xgrammar's kernel: CPU, or CUDA / Triton on a GPU)."""
    import xgrammar as xgr

    n = int(mask.index[-1]) + 1
    bitmask = mask.bitmask[:n].to(logits.device)  # a blocking copy: the host rows are refilled next step
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=mask.index.tolist())


def _take(x: torch.Tensor, mask: np.ndarray, idx: torch.Tensor) -> torch.Tensor:
    """x's rows where mask, without a copy when that is all of them."""
    return x if mask.all() else x[idx]


def _row_seed(seed: int, step: int) -> int:
    """A seeded row's generator seed at `step`: (seed, step) mixed (splitmix64) into the 63 bits
    torch's CPU generator tells apart (manual_seed(2**63) samples as manual_seed(0)), so that
    seeds aliasing in fewer bits (s and s + 2**63, as a wrapped seed + j can be) sample apart."""
    z = (seed + step * _SEED_MIX) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
