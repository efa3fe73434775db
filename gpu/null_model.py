"""A ModelRunner without a model: instant tokens, so the server's own per-token cost can be
measured. Tokens cycle through the real tokenizer's ids for an ordinary English sentence
(never EOS: requests end by max_tokens or stop strings), by position, so a drafted token is
verified as the model would (speculative decoding); the page pool is real. A
constrained row (a grammar's mask) takes its cycle token if the grammar allows it, else the
lowest id it allows, so its text is grammar-valid and the mask's cost is measured. With
--enable-lora its adapters are registered, checked against the model's shapes and kept in the
pool as the real model's are (gpu/lora.py), and its rows hold them, but no delta is computed:
the server's cost of requests naming adapters is measured, not the adapters' arithmetic."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gpu.forward_batch import POOL_LABELS, POOL_SUM, PoolAsk, PromptLogprobsAsk, SeqInput, StepInput, TokenMask
from gpu.kvcache.page_pool import PagePool
from gpu.lora import LoraPool
from gpu.model_runner import ModelRunnerConfig, PromptLogprobsOut, StepOutput
from gpu.models.model_config import ModelConfig
from gpu.models.model_files import resolve_model_dir
from protocol.lora import lora_target_set
from protocol.sampling_params import SamplingParams

SENTENCE = (
    "The quick brown fox jumps over the lazy dog while the evening sun sets slowly "
    "behind the quiet green hills of the valley, and"
)
ALTERNATIVE_LOGPROB = -20.0  # the fixed, negligible logprob reported for top_logprobs alternatives


class NullModelRunner:
    def __init__(self, config: ModelRunnerConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_config = ModelConfig.from_dir(resolve_model_dir(config.model_path), config.context_length)
        tokenizer = AutoTokenizer.from_pretrained(self.model_config.model_dir)
        cycle = tokenizer(SENTENCE, add_special_tokens=False)["input_ids"]
        self.cycle = np.array([t for t in cycle if t not in self.model_config.eos_token_ids], np.int32)
        tokens = config.max_total_tokens or config.max_running_requests * self.model_config.context_length
        self.pool = PagePool(max(1, -(-tokens // config.page_size)), config.page_size)
        R = config.max_running_requests
        self.prompt_len = np.zeros(R, np.int64)  # a token's place in the cycle: its position past the prompt
        self.logprobs = np.zeros(R, bool)
        self.top_logprobs = np.zeros(R, np.int64)
        self.lp_ids: dict[int, np.ndarray] = {}  # rows with logprob_token_ids: those ids
        self.num_logprobs = 0  # rows whose request asked for logprobs
        self.loras: LoraPool | None = None
        if config.enable_lora:  # the adapters' tensors are checked, never used: fp32 on the CPU
            self.loras = LoraPool(
                self.model_config,
                config.max_lora_rank,
                lora_target_set(config.lora_target_modules),
                torch.float32,
                torch.device("cpu"),
                "halves",
                config.max_loras_per_batch,
            )
        self.row_lora = np.zeros(R, np.int64)

    def set_request(self, row: int, params: SamplingParams, prompt_ids: np.ndarray, output_ids: np.ndarray) -> None:
        self.clear_request(row)
        self.prompt_len[row] = len(prompt_ids)
        self.logprobs[row] = params.logprobs
        self.top_logprobs[row] = params.top_logprobs if params.logprobs else 0
        if params.logprob_token_ids:
            self.lp_ids[row] = np.array(params.logprob_token_ids, np.int32)
        self.num_logprobs += params.logprobs
        if params.lora_id and self.loras is not None:
            self.loras.hold(params.lora_id)
            self.row_lora[row] = params.lora_id

    def clear_request(self, row: int) -> None:
        self.num_logprobs -= int(self.logprobs[row])
        self.logprobs[row], self.top_logprobs[row] = False, 0
        self.lp_ids.pop(row, None)
        if self.row_lora[row] and self.loras is not None:
            self.loras.release(int(self.row_lora[row]))
            self.row_lora[row] = 0

    def idle(self) -> None:
        """Nothing is kept between steps."""

    def step(self, seqs: StepInput | Sequence[SeqInput]) -> StepOutput:
        step = StepInput.of(seqs)
        rows = step.rows[step.sample]
        # each sampled token's position (past its sequence's new tokens), counted from the prompt's end
        generated = (step.starts + step.q_lens)[step.sample] - self.prompt_len[rows]
        tokens = self.cycle[generated % len(self.cycle)]
        if step.token_mask is not None:
            _apply_mask(tokens, step.token_mask)
        prompt = None if step.prompt_logprobs is None else self._prompt_logprobs(step.prompt_logprobs)
        if step.pool is not None:
            return StepOutput(
                tokens, np.full(len(rows), np.nan, np.float32), None, None, prompt, self._pooled(step.pool, step)
            )
        if not self.num_logprobs:  # the common case, in two numpy calls fewer
            return StepOutput(tokens, np.full(len(rows), np.nan, np.float32), None, None, prompt)
        logprobs = np.where(self.logprobs[rows], 0.0, np.nan).astype(np.float32)
        K = int(self.top_logprobs[rows].max()) if len(rows) else 0
        if K == 0:
            return StepOutput(tokens, logprobs, None, None, prompt)
        top_ids = self.cycle[(generated[:, None] + np.arange(K)) % len(self.cycle)]  # the chosen token first
        top_lp = np.full((len(rows), K), ALTERNATIVE_LOGPROB, np.float32)
        top_lp[:, 0] = 0.0
        for i, row in enumerate(rows.tolist() if self.lp_ids else ()):  # pinned ids: certain if the token taken
            ids = self.lp_ids.get(row)
            if ids is not None:
                top_ids[i, : len(ids)] = ids
                top_lp[i, : len(ids)] = np.where(ids == tokens[i], 0.0, ALTERNATIVE_LOGPROB)
        return StepOutput(tokens, logprobs, top_ids, top_lp, prompt)

    def _pooled(self, ask: PoolAsk, step: StepInput) -> list[np.ndarray]:
        """Fixed values: every hidden state all ones (a sum: one per token), every label certain."""
        H = self.model_config.hidden_size
        return [
            np.zeros(len(labels), np.float32)
            if kind == POOL_LABELS
            else np.full(H, float(step.q_lens[seq]) if kind == POOL_SUM else 1.0, np.float32)
            for seq, kind, labels in zip(ask.seqs.tolist(), ask.kinds.tolist(), ask.labels)
        ]

    def _prompt_logprobs(self, ask: PromptLogprobsAsk) -> PromptLogprobsOut:
        """Fixed values: every prompt token is certain (logprob 0, rank 1) and the first of its
        top-k, the others cycle tokens at ALTERNATIVE_LOGPROB."""
        N, K = len(ask.targets), ask.top_k
        top_ids = np.empty((N, K), np.int32)
        top_lp = np.full((N, K), ALTERNATIVE_LOGPROB, np.float32)
        if K:
            top_ids[:, 0], top_lp[:, 0] = ask.targets, 0.0
            top_ids[:, 1:] = self.cycle[np.arange(K - 1) % len(self.cycle)]
        return PromptLogprobsOut(np.zeros(N, np.float32), np.ones(N, np.int64), top_ids, top_lp)


def _apply_mask(tokens: np.ndarray, mask: TokenMask) -> None:
    """Replaces each masked sequence's token by the lowest allowed id unless it is allowed."""
    words = mask.bitmask.numpy()[mask.index]  # int32 [M, W]; little-endian hosts: bytes in bit order
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")  # token t: bit t
    chosen = tokens[mask.index]
    ok = allowed[np.arange(len(chosen)), chosen].astype(bool)
    tokens[mask.index] = np.where(ok, chosen, allowed.argmax(axis=1))
