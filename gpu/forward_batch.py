"""One step's batch: the flat token ids, positions and attention metadata of a list of
SeqInputs, built with a handful of vectorised numpy ops whatever the batch size."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu.attention.base import AttentionMetadata


@dataclass(frozen=True)
class SeqInput:
    """One request's slice of one step."""
    row: int               # the request's row in [0, max_running_requests): its sampler state
    token_ids: np.ndarray  # int32 [n], this step's new tokens (n >= 1; n == 1 for decode)
    start: int             # tokens of this request already in the KV cache
    page_ids: np.ndarray   # int32, the pages covering positions [0, start + n), in order
    sample: bool           # this slice ends at the request's last known token: sample one


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor     # int64 [T]
    logits_index: torch.Tensor  # int64 [S], the flat token whose logits are sampled, per sampled seq
    sample_rows: np.ndarray     # int64 [S], their sampler rows
    meta: AttentionMetadata


def build_forward_batch(seqs: list[SeqInput], page_size: int, context_length: int,
                        device: torch.device) -> ForwardBatch:
    if not seqs:
        raise ValueError("step() needs at least one SeqInput")
    B = len(seqs)
    q_lens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, B)
    starts = np.fromiter((s.start for s in seqs), np.int64, B)
    n_pages = np.fromiter((len(s.page_ids) for s in seqs), np.int64, B)
    kv_lens = starts + q_lens
    need = -(-kv_lens // page_size)
    bad = np.flatnonzero((q_lens < 1) | (starts < 0) | (n_pages < need) | (kv_lens > context_length))
    if len(bad):
        s = seqs[bad[0]]
        raise ValueError(f"SeqInput of row {s.row}: {len(s.token_ids)} tokens from start {s.start} "
                         f"need >= 1 token, {need[bad[0]]} pages (has {len(s.page_ids)}) and at most "
                         f"context_length={context_length} positions")
    input_ids = np.concatenate([s.token_ids for s in seqs]).astype(np.int64)
    flat_pages = np.concatenate([s.page_ids for s in seqs]).astype(np.int32)
    page_off = np.cumsum(n_pages) - n_pages

    qo_indptr = np.zeros(B + 1, np.int64)
    np.cumsum(q_lens, out=qo_indptr[1:])
    T = int(qo_indptr[-1])
    tok_seq = np.repeat(np.arange(B), q_lens)
    positions = np.arange(T) - qo_indptr[tok_seq] + starts[tok_seq]
    out_cache_loc = flat_pages[page_off[tok_seq] + positions // page_size].astype(np.int64) * page_size \
        + positions % page_size

    max_pages = int(need.max())
    col = np.arange(max_pages)
    valid = col[None, :] < need[:, None]                       # [B, max_pages]
    page_table = np.zeros((B, max_pages), np.int32)
    page_table[valid] = flat_pages[(page_off[:, None] + col[None, :])[valid]]
    kv_page_indptr = np.zeros(B + 1, np.int32)
    np.cumsum(need, out=kv_page_indptr[1:])

    sample = np.fromiter((s.sample for s in seqs), bool, B)
    logits_index = qo_indptr[1:][sample] - 1
    sample_rows = np.fromiter((s.row for s in seqs), np.int64, B)[sample]

    qo_indptr32, kv_lens32 = qo_indptr.astype(np.int32), kv_lens.astype(np.int32)
    t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)
    meta = AttentionMetadata(
        qo_indptr=t(qo_indptr32), kv_lens=t(kv_lens32), page_table=t(page_table),
        out_cache_loc=t(out_cache_loc), positions=t(positions),
        kv_page_indptr=t(kv_page_indptr), kv_page_ids=t(page_table[valid]),
        qo_indptr_host=qo_indptr32, kv_lens_host=kv_lens32, page_table_host=page_table,
        max_q_len=int(q_lens.max()), max_kv_len=int(kv_lens.max()))
    return ForwardBatch(t(input_ids), t(logits_index), sample_rows, meta)
