"""Attention in plain torch: the CPU backend and the reference the other backends are
tested against. Requests are split into two groups, decode (one new token) and extend
(several), each padded to a dense batch and run through scaled_dot_product_attention with
a boolean mask; the gather indices and masks are built once per step in plan(). It also runs
what the other backends do not (configure()): per-layer sliding windows (one more mask per
window) and soft-capped scores (attention in matmuls and softmax, as transformers' eager)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class _Group:
    q_index: torch.Tensor  # int64 [G, Qmax], flat token of each padded query (0 where padding)
    pages: torch.Tensor  # int64 [G * Pmax], each request's pages, padded with its first page
    mask: torch.Tensor | None  # bool [G, 1, Qmax, Kmax], True where the query may see the key; None: plain causal
    out_tokens: torch.Tensor | None  # int64 [n], flat tokens this group produces; None: all, in order
    out_valid: torch.Tensor | None  # int64 [n], their positions in the flattened [G * Qmax] output
    window_masks: dict[int, torch.Tensor]  # sliding window -> mask as `mask`, narrowed to it


class TorchNativeBackend(AttentionBackend):
    WINDOWS_AND_SOFTCAP = True
    windows: tuple[int | None, ...] = ()
    softcap: float | None = None

    def configure(
        self, scale: float, sliding_windows: tuple[int | None, ...] = (), softcap: float | None = None
    ) -> None:
        super().configure(scale, sliding_windows, softcap)
        self.windows, self.softcap = tuple(sliding_windows), softcap

    def plan(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        q_lens = np.diff(meta.qo_indptr_host)
        decode = q_lens == 1
        device = self.kv_cache.device
        self.groups = [self._group(np.flatnonzero(sel), meta, device) for sel in (decode, ~decode) if sel.any()]
        if len(self.groups) == 1 and (q_lens == q_lens[0]).all():
            # no padding (decode only, or one prompt): the padded queries are the tokens, in order
            g = self.groups[0]
            self.groups = [_Group(g.q_index, g.pages, g.mask, None, None, g.window_masks)]

    def _group(self, seqs: np.ndarray, meta: AttentionMetadata, device: torch.device) -> _Group:
        ps = self.kv_cache.page_size
        q_start = meta.qo_indptr_host[seqs].astype(np.int64)
        q_len = meta.qo_indptr_host[seqs + 1] - q_start
        kv_len = meta.kv_lens_host[seqs].astype(np.int64)
        q_max, kv_max = int(q_len.max()), int(kv_len.max())
        qi = np.arange(q_max)
        q_ok = qi[None, :] < q_len[:, None]  # [G, Qmax]
        q_index = np.where(q_ok, q_start[:, None] + qi[None, :], 0)
        n_pages = -(-kv_max // ps)
        pages = meta.page_table_host[seqs][:, :n_pages].astype(np.int64)  # [G, Pmax]
        # padding points at the request's first page: written, so finite, and masked out
        pages = np.where(np.arange(n_pages)[None, :] < -(-kv_len // ps)[:, None], pages, pages[:, :1])
        kj = np.arange(n_pages * ps)
        kv_ok = kj[None, :] < kv_len[:, None]
        # query i of a request sits at position kv_len - q_len + i and sees keys up to it
        q_pos = (kv_len - q_len)[:, None] + qi[None, :]  # [G, Qmax]
        mask = (kj[None, None, :] <= q_pos[:, :, None]) & kv_ok[:, None, :]  # [G, Qmax, Kmax]
        valid = np.flatnonzero(q_ok)
        as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
        window_masks = {
            w: as_t((mask & (kj[None, None, :] > q_pos[:, :, None] - w))[:, None])
            for w in sorted({w for w in self.windows if w is not None})
        }
        # one whole prompt with no cached prefix: SDPA's own causal mask (top-left aligned, so the
        # padding keys past the prompt stay unseen) lets the kernel skip the masked half
        plain_causal = len(seqs) == 1 and q_max > 1 and kv_len[0] == q_max
        return _Group(
            as_t(q_index),
            as_t(pages.reshape(-1)),
            None if plain_causal else as_t(mask[:, None]),
            as_t(q_index.reshape(-1)[valid]),
            as_t(valid),
            window_masks,
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.store_kv(k, v, layer_id, self.meta.out_cache_loc)
        if len(self.groups) == 1 and self.groups[0].out_tokens is None:
            return self._group_output(self.groups[0], q, layer_id)
        o = torch.empty_like(q)
        for g in self.groups:
            o[g.out_tokens] = self._group_output(g, q, layer_id)[g.out_valid]
        return o

    def _group_output(self, g: _Group, q: torch.Tensor, layer_id: int) -> torch.Tensor:
        """The attention output of group g's queries, [G * Qmax, Hq, D] (its padded queries in order)."""
        G, Q = g.q_index.shape
        qg = q.view(G, Q, *q.shape[1:]) if g.out_tokens is None else q[g.q_index]  # [G, Qmax, Hq, D]
        return self._attend(g, qg, layer_id).reshape(G * Q, *q.shape[1:])

    def _attend(self, g: _Group, qg: torch.Tensor, layer_id: int) -> torch.Tensor:
        """qg: [G, Qmax, Hq, D] -> [G, Qmax, Hq, D]"""
        k_pages, v_pages = self.kv_cache.k_pages(layer_id), self.kv_cache.v_pages(layer_id)
        G, Q = g.q_index.shape
        Hq, Hkv, D = self.num_q_heads, self.num_kv_heads, self.head_dim
        # whole pages by index_select (a row memcpy each), far faster than gathering slots; a
        # narrower cache (--kv-cache-dtype) is widened to the queries' dtype for SDPA
        kg = k_pages.index_select(0, g.pages).to(qg.dtype).view(G, -1, Hkv, D).transpose(1, 2)  # [G, Hkv, Kmax, D]
        vg = v_pages.index_select(0, g.pages).to(qg.dtype).view(G, -1, Hkv, D).transpose(1, 2)
        window = self.windows[layer_id] if self.windows else None
        mask = g.mask if window is None else g.window_masks[window]
        if self.softcap is not None:
            return self._attend_softcapped(qg, kg, vg, mask, self.softcap)
        if window is not None:
            g = _Group(g.q_index, g.pages, mask, g.out_tokens, g.out_valid, {})  # its window's mask is `mask` now
        if Q == 1:
            # one query per request: its heads sharing a kv head act as that head's queries,
            # plain multi-head attention with no kv expansion
            og = F.scaled_dot_product_attention(
                qg.view(G, Hkv, Hq // Hkv, D), kg, vg, attn_mask=g.mask, scale=self.scale
            )  # [G, Hkv, Hq / Hkv, D]
            # reshape: SDPA's CUDA kernels may return og in another memory layout than [G, Hkv, g, D]
            return og.reshape(G, 1, Hq, D)
        og = F.scaled_dot_product_attention(
            qg.transpose(1, 2), kg, vg, attn_mask=g.mask, is_causal=g.mask is None, scale=self.scale, enable_gqa=True
        )  # [G, Hq, Qmax, D]
        return og.transpose(1, 2)

    def _attend_softcapped(
        self, qg: torch.Tensor, kg: torch.Tensor, vg: torch.Tensor, mask: torch.Tensor | None, softcap: float
    ) -> torch.Tensor:
        """qg: [G, Qmax, Hq, D], kg, vg: [G, Hkv, Kmax, D], mask: [G, 1, Qmax, Kmax] or None (plain
        causal from the first key) -> [G, Qmax, Hq, D]; scores capped, then masked, softmax in fp32."""
        G, Q, Hq, D = qg.shape
        rep = Hq // self.num_kv_heads
        k, v = kg.repeat_interleave(rep, dim=1), vg.repeat_interleave(rep, dim=1)  # [G, Hq, Kmax, D]
        scores = torch.matmul(qg.transpose(1, 2), k.transpose(2, 3)) * self.scale  # [G, Hq, Qmax, Kmax]
        scores = torch.tanh(scores / softcap) * softcap
        if mask is None:
            mask = torch.ones(Q, k.shape[2], dtype=torch.bool, device=qg.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype)
        return torch.matmul(probs, v).transpose(1, 2)  # [G, Qmax, Hq, D]
