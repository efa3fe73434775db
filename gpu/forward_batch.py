"""One step's batch: the flat token ids, positions and attention metadata of the step's
sequences, built with a handful of vectorised numpy ops whatever the batch size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention.base import AttentionMetadata


@dataclass(frozen=True)
class SeqInput:
    """One request's slice of one step."""

    row: int  # the request's row in [0, max_running_requests): its sampler state
    token_ids: np.ndarray  # int32 [n], this step's new tokens (n >= 1; n == 1 for decode)
    start: int  # tokens of this request already in the KV cache
    page_ids: np.ndarray  # int32, the pages covering positions [0, start + n), in order
    sample: bool  # this slice ends at the request's last known token: sample one


@dataclass(frozen=True)
class TokenMask:
    """The tokens some of a step's sampled sequences may take (constrained decoding): applied
    to their logits after penalties, before the token is chosen (gpu/sampling/sampler.py)."""

    bitmask: torch.Tensor  # int32 [N, ceil(V / 32)] on the host; bit j of word k allows token 32k + j
    index: np.ndarray  # int64 [M], ascending: the sampled sequences masked (their order among the
    #                    step's sampled ones); sequence index[i] reads bitmask row index[i]


@dataclass(frozen=True)
class PromptLogprobsAsk:
    """The step's sequences whose prompt logprobs are wanted: for each, a run of its new
    tokens whose logits are gathered at the tokens they predict (the next prompt tokens)."""

    seqs: np.ndarray  # int64 [Q], indexes into the step's sequences, ascending
    first: np.ndarray  # int64 [Q], the run's first token, counted from the sequence's first new token
    counts: np.ndarray  # int64 [Q], the run's tokens (>= 1)
    targets: np.ndarray  # int64 [sum(counts)], the token each one predicts, run after run
    top_k: int  # alternatives reported per position (the most any of them asked for)


# PoolAsk.kinds: what is read of a sequence's final hidden states (after the model's last norm)
POOL_SUM = 0  # their sum over the sequence's new tokens (a mean, over a prompt's chunks)
POOL_FIRST = 1  # its first new token's
POOL_LAST = 2  # its last new token's
POOL_LABELS = 3  # the log-softmax of its last new token's logits, at the sequence's label ids


@dataclass(frozen=True)
class PoolAsk:
    """The step's sequences whose final hidden states are pooled (embeddings, scores) rather
    than sampled from: one float32 vector each comes back (StepOutput.pooled)."""

    seqs: np.ndarray  # int64 [Q], indexes into the step's sequences
    kinds: np.ndarray  # int64 [Q], POOL_*
    labels: tuple[np.ndarray, ...]  # per entry: int64 label token ids (POOL_LABELS), else empty


@dataclass(frozen=True)
class StepInput:
    """A step's sequences as columns: what the scheduler hands the runner, built from its
    request table without an object per request (with many running requests, a SeqInput each
    is a large share of the scheduler's time a step). A list of SeqInputs converts with of()."""

    rows: np.ndarray  # int64 [B], the sampler rows
    starts: np.ndarray  # int64 [B], tokens of each sequence already in the KV cache
    q_lens: np.ndarray  # int64 [B], its new tokens this step (>= 1)
    token_ids: np.ndarray  # int32 [sum(q_lens)], the new tokens, sequence after sequence
    page_table: np.ndarray  # int32 [B, P], each sequence's pages in order; entries past num_pages unused
    num_pages: np.ndarray  # int64 [B]
    sample: np.ndarray  # bool [B], sample a token after this sequence's last new one
    token_mask: TokenMask | None = None  # None: no sampled sequence is constrained
    prompt_logprobs: PromptLogprobsAsk | None = None  # None: no sequence asks (the common case)
    pool: PoolAsk | None = None  # None: no sequence is pooled (the common case)

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def of(cls, seqs: StepInput | Sequence[SeqInput]) -> StepInput:
        if isinstance(seqs, StepInput):
            return seqs
        B = len(seqs)
        num_pages = np.fromiter((len(s.page_ids) for s in seqs), np.int64, B)
        page_table = np.zeros((B, int(num_pages.max()) if B else 0), np.int32)
        for b, s in enumerate(seqs):
            page_table[b, : num_pages[b]] = s.page_ids
        return cls(
            rows=np.fromiter((s.row for s in seqs), np.int64, B),
            starts=np.fromiter((s.start for s in seqs), np.int64, B),
            q_lens=np.fromiter((len(s.token_ids) for s in seqs), np.int64, B),
            token_ids=np.concatenate([np.asarray(s.token_ids, np.int32).reshape(-1) for s in seqs])
            if B
            else np.zeros(0, np.int32),
            page_table=page_table,
            num_pages=num_pages,
            sample=np.fromiter((s.sample for s in seqs), bool, B),
        )


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    logits_index: torch.Tensor  # int64 [S], the flat token whose logits are sampled, per sampled seq
    sample_rows: np.ndarray  # int64 [S], their sampler rows
    meta: AttentionMetadata
    prompt_index: torch.Tensor | None = None  # int64 [N], the flat tokens whose prompt logprobs are gathered
    prompt_targets: torch.Tensor | None = None  # int64 [N], the token each of them predicts
    qo_indptr: np.ndarray | None = None  # int64 [B + 1], each sequence's first flat token (pooled steps)


def build_forward_batch(
    seqs: StepInput | Sequence[SeqInput], page_size: int, context_length: int, device: torch.device
) -> ForwardBatch:
    step = StepInput.of(seqs)
    B = len(step)
    if B == 0:
        raise ValueError("step() needs at least one sequence")
    q_lens, starts, n_pages = step.q_lens, step.starts, step.num_pages
    kv_lens = starts + q_lens
    need = -(-kv_lens // page_size)
    bad = np.flatnonzero((q_lens < 1) | (starts < 0) | (n_pages < need) | (kv_lens > context_length))
    if len(bad):
        b = bad[0]
        raise ValueError(
            f"the sequence of row {step.rows[b]}: {q_lens[b]} tokens from start {starts[b]} "
            f"need >= 1 token, {need[b]} pages (has {n_pages[b]}) and at most "
            f"context_length={context_length} positions"
        )
    if len(step.token_ids) != int(q_lens.sum()):
        raise ValueError(f"{len(step.token_ids)} token ids for {int(q_lens.sum())} new tokens")
    input_ids = step.token_ids.astype(np.int64)

    qo_indptr = np.zeros(B + 1, np.int64)
    np.cumsum(q_lens, out=qo_indptr[1:])
    T = int(qo_indptr[-1])
    tok_seq = np.repeat(np.arange(B), q_lens)
    positions = np.arange(T) - qo_indptr[tok_seq] + starts[tok_seq]
    out_cache_loc = (
        step.page_table[tok_seq, positions // page_size].astype(np.int64) * page_size + positions % page_size
    )

    max_pages = int(need.max())
    valid = np.arange(max_pages)[None, :] < need[:, None]  # [B, max_pages]
    page_table = np.where(valid, step.page_table[:, :max_pages], 0).astype(np.int32)
    kv_page_indptr = np.zeros(B + 1, np.int32)
    np.cumsum(need, out=kv_page_indptr[1:])

    logits_index = qo_indptr[1:][step.sample] - 1
    sample_rows = step.rows[step.sample]

    qo_indptr32, kv_lens32 = qo_indptr.astype(np.int32), kv_lens.astype(np.int32)
    t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)
    meta = AttentionMetadata(
        qo_indptr=t(qo_indptr32),
        kv_lens=t(kv_lens32),
        page_table=t(page_table),
        out_cache_loc=t(out_cache_loc),
        positions=t(positions),
        kv_page_indptr=t(kv_page_indptr),
        kv_page_ids=t(page_table[valid]),
        qo_indptr_host=qo_indptr32,
        kv_lens_host=kv_lens32,
        page_table_host=page_table,
        max_q_len=int(q_lens.max()),
        max_kv_len=int(kv_lens.max()),
    )
    prompt_index = prompt_targets = None
    ask = step.prompt_logprobs
    if ask is not None:
        run_start = qo_indptr[ask.seqs] + ask.first  # each run's first flat token
        before = np.cumsum(ask.counts) - ask.counts  # each run's first entry in the flat index
        flat = np.repeat(run_start - before, ask.counts) + np.arange(int(ask.counts.sum()))
        prompt_index, prompt_targets = t(flat), t(np.asarray(ask.targets, np.int64))
    return ForwardBatch(
        t(input_ids),
        t(logits_index),
        sample_rows,
        meta,
        prompt_index,
        prompt_targets,
        qo_indptr if step.pool is not None else None,
    )
