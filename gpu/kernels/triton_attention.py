"""Triton attention over a paged KV cache: decode (split-K, flash-decoding style) and extend.

Cache layout (per layer): k_cache, v_cache [num_pages, page_size, Hkv, D]. Token n of request b
lives in slot page_table[b, n // page_size] * page_size + n % page_size of the flattened
[num_pages * page_size, Hkv, D] view, so pages may be scattered anywhere in the pool and any
page size works (it is a compile-time constant, one specialisation per size).

Both kernels run under TRITON_INTERPRET=1 on the CPU (that is how they are tested) and compiled
on CUDA. Softmax uses exp2 with the scale folded in (log2(e) * sm_scale) and accumulates in fp32;
fp32 inputs use exact ("ieee") dots so fp32 results match the torch reference on CUDA too.
"""

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# triton makes the kernels below interpreted or compiled when they are defined, i.e. now.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    Page_table,
    Kv_lens,
    Out,
    Out_lse,
    qk_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_kslot,
    stride_kh,
    stride_vslot,
    stride_vh,
    stride_ptb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One program per (request, kv head, split): the GROUP query heads sharing a kv head are one
    # tile, so each K/V block is loaded once per group, not once per query head.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    offs_h = kvh * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    # q: [BLOCK_H, BLOCK_D]
    q = tl.load(
        Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )

    kv_len = tl.load(Kv_lens + b)
    split_len = tl.cdiv(kv_len, num_splits)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(Page_table + b * stride_ptb + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        # k, v: [BLOCK_N, BLOCK_D]
        k = tl.load(
            K + slot[:, None] * stride_kslot + kvh * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slot[:, None] * stride_vslot + kvh * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty split (kv_len < num_splits) leaves l_i == 0: it writes o = 0 and lse = -inf so the
    # merge gives it zero weight.
    has_kv = l_i > 0
    o = acc / tl.where(has_kv, l_i, 1.0)[:, None]
    tl.store(
        Out + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        o,
        mask=mask_h[:, None] & mask_d[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(has_kv, m_i + tl.log2(tl.where(has_kv, l_i, 1.0)), float("-inf"))
        tl.store(Out_lse + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    Part_o,
    Part_lse,
    Out,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program per (request, query head): weight each split's normalised output by its
    # share of the total softmax mass, exp2(lse_s - lse_total).
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    lse = tl.load(Part_lse + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    # part: [BLOCK_S, BLOCK_D]
    part = tl.load(
        Part_o + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    o = tl.sum(w[:, None] * part, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, o, mask=mask_d)


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Qo_indptr,
    Page_table,
    Kv_lens,
    Out,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kslot,
    stride_kh,
    stride_vslot,
    stride_vh,
    stride_ptb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One program per (request, query head, block of BLOCK_M new tokens).
    b = tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M

    q_start = tl.load(Qo_indptr + b)
    q_len = tl.load(Qo_indptr + b + 1) - q_start
    if m0 >= q_len:
        return
    kv_len = tl.load(Kv_lens + b)
    prefix_len = kv_len - q_len
    kvh = h // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    # q: [BLOCK_M, BLOCK_D]
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    # Causal: new token i sees kv positions [0, prefix_len + i]; the block's last row bounds the loop.
    q_pos = prefix_len + offs_m
    end = tl.minimum(kv_len, prefix_len + m0 + BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        page = tl.load(Page_table + b * stride_ptb + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        # k, v: [BLOCK_N, BLOCK_D]
        k = tl.load(
            K + slot[:, None] * stride_kslot + kvh * stride_kh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        # Every row keeps position 0 (q_pos >= 0), so no row is all -inf and no NaN appears.
        s = tl.where(mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + slot[:, None] * stride_vslot + kvh * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        o,
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """Validates shapes shared by both kernels; returns (page_size, group, head_dim)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache: expected equal [num_pages, page_size, Hkv, D] shapes, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: must be contiguous")
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q: expected [*, Hq, {head_dim}], got {tuple(q.shape)}")
    num_q_heads = q.shape[1]
    if q.stride(2) != 1:
        raise ValueError("q: the head_dim axis must be contiguous")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: Hq={num_q_heads} is not a multiple of the cache's Hkv={num_kv_heads}")
    return page_size, num_q_heads // num_kv_heads, head_dim


def _check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dtype != torch.int32 or t.dim() != dim:
        raise ValueError(f"{name}: expected an int32 tensor of {dim} dims, got {t.dtype} {tuple(t.shape)}")


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(
            f"out: expected shape {tuple(q.shape)} with a contiguous last axis, "
            f"got {tuple(out.shape)} strides {out.stride()}"
        )
    return out


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_n(dtype: torch.dtype, head_dim: int) -> int:
    # fp32 tiles of 128-wide heads are twice the bytes: halve the kv block so the pipelined
    # K/V buffers still fit the shared memory of pre-Hopper GPUs.
    return 32 if dtype == torch.float32 and head_dim > 64 else 64


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per request attending to its whole cached context.

    q: [B, Hq, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D]; page_table: int32 [B, max_pages];
    kv_lens: int32 [B] (>= 1, the new token included). num_kv_splits > 1 splits each request's
    context across that many programs and merges them in a second kernel (flash-decoding), which
    keeps the GPU busy when B * Hkv is small and contexts are long. Returns o: [B, Hq, D].
    """
    page_size, group, head_dim = _check_cache(q, k_cache, v_cache)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits: must be >= 1, got {num_kv_splits}")
    _check_index("page_table", page_table, 2)
    _check_index("kv_lens", kv_lens, 1)
    batch, num_q_heads, _ = q.shape
    num_kv_heads = k_cache.shape[2]
    out = _output(q, out)
    if batch == 0:
        return out
    k = k_cache.view(-1, num_kv_heads, head_dim)
    v = v_cache.view(-1, num_kv_heads, head_dim)
    block_d = triton.next_power_of_2(head_dim)
    # tl.dot needs M >= 16 on GPUs; rows past GROUP are masked.
    block_h = max(16, triton.next_power_of_2(group))
    grid = (batch, num_kv_heads, num_kv_splits)
    qk_scale = sm_scale * _LOG2E
    common = dict(
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=_block_n(q.dtype, head_dim),
        PRECISION=_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    if num_kv_splits == 1:
        # A single split is already the final answer: write straight into out, no merge kernel.
        _decode_split_kernel[grid](
            q,
            k,
            v,
            page_table,
            kv_lens,
            out,
            out,
            qk_scale,
            1,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            page_table.stride(0),
            out.stride(0),
            out.stride(1),
            0,
            0,
            0,
            WRITE_LSE=False,
            **common,
        )
        return out
    part_o = torch.empty(batch, num_q_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_q_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[grid](
        q,
        k,
        v,
        page_table,
        kv_lens,
        part_o,
        part_lse,
        qk_scale,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        page_table.stride(0),
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        WRITE_LSE=True,
        **common,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        part_o,
        part_lse,
        out,
        num_kv_splits,
        part_o.stride(0),
        part_o.stride(1),
        part_o.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        num_warps=4,
    )
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    max_q_len: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix and themselves.

    q: [T, Hq, D] ragged by qo_indptr int32 [B+1]; kv_lens int32 [B] counts all of a request's
    tokens, the new ones included (already stored in the cache); new token i of request b sees
    kv positions [0, kv_len - q_len + i]. max_q_len (a host int, >= every q_len) sizes the grid
    without a device sync. Rows with q_len == 1 (decode rows in a mixed batch) are fine.
    Returns o: [T, Hq, D].
    """
    page_size, group, head_dim = _check_cache(q, k_cache, v_cache)
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    _check_index("qo_indptr", qo_indptr, 1)
    _check_index("page_table", page_table, 2)
    _check_index("kv_lens", kv_lens, 1)
    batch = qo_indptr.numel() - 1
    out = _output(q, out)
    if batch == 0 or max_q_len == 0:
        return out
    k = k_cache.view(-1, num_kv_heads, head_dim)
    v = v_cache.view(-1, num_kv_heads, head_dim)
    block_m = 64 if max_q_len > 32 else max(16, triton.next_power_of_2(max_q_len))
    grid = (batch, num_q_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q,
        k,
        v,
        qo_indptr,
        page_table,
        kv_lens,
        out,
        sm_scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=_block_n(q.dtype, head_dim),
        PRECISION=_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out
