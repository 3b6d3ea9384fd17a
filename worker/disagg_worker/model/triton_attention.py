"""Paged attention on CUDA as Triton kernels that read K/V straight from the pool through a page table.

The torch path (`attention.py`) gathers every request's K/V into a padded copy before attending; on a GPU
that copy costs as much memory traffic as the attention itself. These kernels index the pool instead: key
`t` of request `b` lives at `k_buf[pages[b, t // page_size], t % page_size]`, the pool layout that
`batch.py` describes (a sequence's slot j is on its page j // page_size at offset j % page_size).

- decode (one query per request): flash-decoding. Each program takes one request, one KV head with
  all its query heads (grouped-query attention: the group is the rows of one `tl.dot`) and one split of
  the request's pages, and writes a partial result (output normalised by its own softmax sum, and its
  log-sum-exp); a second kernel merges the splits. Splitting the pages keeps a GPU busy when a few long
  requests are decoded: without it there are only batch * kv_heads programs.
- extend (prefill, chunked prefill over a cached prefix, mixed batches): flash-attention over blocks of
  one request's queries; query j of a request with `seq_len` keys and `n` new tokens sits at position
  `seq_len - n + j` and sees keys 0..that position.

Softmax statistics and accumulators are float32; K/V are cast to q's dtype first, as the torch path does.
float32 products use `input_precision="ieee"` (a GPU's default tf32 would round them to 10 bits of
mantissa). Tests run these kernels on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1) and compile
them for sm_90 without a GPU; they have not yet run on a GPU (tests/gpu/test_cuda_engine.py is that check).
`AttentionPlan.build` makes `PageTables` only on CUDA, so the CPU serving path never reaches this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.nn.utils.rnn import pad_sequence

from disagg_worker.model.batch import ForwardBatch

# Decode splits: enough programs to fill a GPU (an H200 has 132 SMs) when batch * kv_heads is small, at
# most MAX_SPLITS, and none shorter than MIN_SPLIT_TOKENS (a split's fixed cost is its launch and merge).
TARGET_PROGRAMS = 512
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 128


@dataclass(frozen=True)
class PageTables:
    """Per forward, what the kernels index the pool with; built once and shared by every layer."""

    pages: torch.Tensor  # [B, max_pages] int32: request b's j-th page (padded with page 0)
    seq_lens: torch.Tensor  # [B] int32: keys per request, the new tokens included
    q_starts: torch.Tensor  # [B] int32: the request's first row of q
    q_lens: torch.Tensor  # [B] int32: its new tokens (rows of q)
    max_seq_len: int
    max_q_len: int  # 1 for a decode batch

    @property
    def is_decode(self) -> bool:
        return self.max_q_len == 1


def page_tables(batch: ForwardBatch, page_size: int, device: torch.device) -> PageTables:
    """The page table of each request from its slots: the slots at offsets 0, page_size, ... of its sequence,
    divided by page_size (a sequence starts each page at offset 0)."""
    slots = pad_sequence([s.to(device) for s in batch.kv_slots], batch_first=True)  # [B, max_seq_len]
    q_lens = torch.tensor(batch.extend_lens, dtype=torch.int32, device=device)
    return PageTables(
        pages=(slots[:, ::page_size] // page_size).to(torch.int32),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
        q_starts=torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens,
        q_lens=q_lens,
        max_seq_len=max(batch.seq_lens),
        max_q_len=max(batch.extend_lens),
    )


def triton_paged_attention(
    q: torch.Tensor, tables: PageTables, k_buf: torch.Tensor, v_buf: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """`attention.paged_attention` through the kernels: q [T, H, D] over pool buffers [num_pages, page_size,
    H_kv, D]; returns [T, H, D] in q's dtype. The scale defaults to D ** -0.5, as SDPA's does."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q.contiguous()
    if tables.is_decode:
        return decode_attention(q, k_buf, v_buf, tables.pages, tables.seq_lens, scale, max_seq_len=tables.max_seq_len)
    return extend_attention(
        q, k_buf, v_buf, tables.pages, tables.q_starts, tables.q_lens, tables.seq_lens, tables.max_q_len, scale
    )


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    pages: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query per request, q [B, H, D], over its `seq_lens[b]` keys on pages `pages[b]`; returns [B, H, D].
    `num_splits` (default: `decode_splits`) sets how many programs share one request's pages."""
    batch, heads, head_dim = q.shape
    page_size, kv_heads = k_buf.shape[1], k_buf.shape[2]
    _check(q, k_buf, v_buf, heads, kv_heads)
    if num_splits is None:
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = decode_splits(batch, kv_heads, longest)
    mid_out = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    block_d = _block_d(head_dim)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_buf, v_buf, pages, seq_lens, mid_out, mid_lse, scale,
        *q.stride()[:2], *k_buf.stride()[:3], *v_buf.stride()[:3], pages.stride(0),
        *mid_out.stride()[:3], *mid_lse.stride()[:2],
        num_splits, head_dim,
        GROUP=group, PAGE_SIZE=page_size, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if head_dim <= 64 else 32, BLOCK_D=block_d, PRECISION=_precision(q),
    )  # fmt: skip
    out = torch.empty_like(q)
    _decode_merge_kernel[(batch, heads)](
        mid_out, mid_lse, out,
        *mid_out.stride()[:3], *mid_lse.stride()[:2], *out.stride()[:2],
        num_splits, head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
    )  # fmt: skip
    return out


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    pages: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    """Rows q_starts[b]..q_starts[b] + q_lens[b] of q [T, H, D] are request b's new tokens, the last q_lens[b]
    of its seq_lens[b] keys (on pages `pages[b]`); each attends causally with that offset. Returns [T, H, D]."""
    tokens, heads, head_dim = q.shape
    page_size, kv_heads = k_buf.shape[1], k_buf.shape[2]
    _check(q, k_buf, v_buf, heads, kv_heads)
    out = torch.empty_like(q)
    block_m, block_n = (64, 64) if head_dim <= 64 else (32, 32)
    grid = (triton.cdiv(max_q_len, block_m), q_lens.shape[0], heads)
    _extend_kernel[grid](
        q, k_buf, v_buf, pages, q_starts, q_lens, seq_lens, out, scale,
        *q.stride()[:2], *k_buf.stride()[:3], *v_buf.stride()[:3], pages.stride(0), *out.stride()[:2],
        head_dim,
        GROUP=heads // kv_heads, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_block_d(head_dim), PRECISION=_precision(q),
    )  # fmt: skip
    return out


def decode_splits(batch: int, kv_heads: int, max_seq_len: int) -> int:
    """How many splits each request's pages get in a decode: see TARGET_PROGRAMS."""
    wanted = max(1, TARGET_PROGRAMS // max(1, batch * kv_heads))
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS)))


def _check(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, heads: int, kv_heads: int) -> None:
    """The kernels take the last dimension as contiguous and query head h as reading KV head h // (H / H_kv)."""
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    if q.stride(-1) != 1 or k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1:
        raise ValueError("q and the pool buffers must be contiguous in head_dim")


def _block_d(head_dim: int) -> int:
    """Head dims are padded (and masked) to a power of two, at least 16 (a `tl.dot` operand's minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def _precision(q: torch.Tensor) -> str:
    """float32 products exactly, as torch computes them; 16-bit products are exact in any mode."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _decode_split_kernel(
    Q, K, V, Pages, SeqLens, MidOut, MidLse, scale,
    stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pb,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    num_splits, head_dim,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (b, kv_head, split): the GROUP query heads of kv_head over split's share of b's pages."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    pages_per_split = tl.cdiv(tl.cdiv(seq_len, PAGE_SIZE), num_splits)
    start = split * pages_per_split * PAGE_SIZE
    end = tl.minimum(start + pages_per_split * PAGE_SIZE, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < head_dim
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for first in range(start, end, BLOCK_N):
        keys = first + offs_n
        n_mask = keys < end
        page = tl.load(Pages + b * stride_pb + keys // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kp + (keys % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_vp + (keys % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # An empty split (a short request among long ones) leaves l_i = 0: its output 0, its lse -inf, weight 0.
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(has_keys, m_i + tl.log(safe_l), float("-inf"))
    mid = MidOut + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_d[None, :]
    tl.store(mid, out, mask=h_mask[:, None] & d_mask[None, :])
    tl.store(MidLse + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    MidOut, MidLse, Out,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program (b, head): the splits' outputs weighted by exp(lse_split - lse_total)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(MidLse + b * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    parts = tl.load(
        MidOut + b * stride_mb + head * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(Out + b * stride_ob + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


@triton.jit
def _extend_kernel(
    Q, K, V, Pages, QStarts, QLens, SeqLens, Out, scale,
    stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_pb,
    stride_ot, stride_oh,
    head_dim,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (block, b, head): BLOCK_M of request b's queries, one head, over the keys they may see."""
    block = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(QLens + b)
    if block * BLOCK_M >= q_len:
        return
    q_start = tl.load(QStarts + b)
    seq_len = tl.load(SeqLens + b)
    kv_head = head // GROUP

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_mask = m_mask[:, None] & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    positions = seq_len - q_len + offs_m  # every query sees key 0, so each row's running max is finite
    end = tl.minimum(seq_len, seq_len - q_len + (block + 1) * BLOCK_M)  # the block's last query sees < end

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for first in range(0, end, BLOCK_N):
        keys = first + offs_n
        n_mask = keys < end
        page = tl.load(Pages + b * stride_pb + keys // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_rows = page * stride_kp + (keys % PAGE_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(K + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (keys[None, :] <= positions[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = page * stride_vp + (keys % PAGE_SIZE) * stride_vs + kv_head * stride_vh
        v = tl.load(V + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty), mask=q_mask
    )
