"""Attention over the paged KV pool.

Each forward first writes the new tokens' K/V into the pool at `batch.out_slots`, then every
request attends over its whole sequence (`batch.kv_slots[i]`), read back from the pool. Query j of
request i sits at position `seq_len - extend_len + j` and sees keys 0..that position.

Two paths, same result:
- decode (every request has one new token): K/V gathered into one padded [B, Lmax] batch with a
  length mask, one `scaled_dot_product_attention` call; in a 16-bit dtype on a CPU two matmuls and a
  softmax in float32 instead (`_decode_upcast`): torch's CPU SDPA kernel in bfloat16 is tiled for long
  queries and takes 140 us for one query over 200 keys of SmolLM2's 9 heads where the float32 matmuls
  take 38, 6.5 ms for 32 queries over 300 keys where they take 1.3, and its results are no closer to
  float32 attention (max error 1e-3 for both);
- extend (prefill, chunked prefill, mixed batches): one call per request with an offset causal mask
  (plain `is_causal` when nothing is cached yet, so fused kernels apply).
The index tensors and masks are built once per forward (`AttentionPlan.build`) and shared by all layers.

On CUDA, given the pool's page size, the plan also holds page tables and `paged_attention` runs the Triton
kernels of `triton_attention.py` instead, which read K/V straight from the pool; the CPU path is the above.
Prompts without a cached prefix (`AttentionPlan.fresh`) take the extend path above there too: SDPA's flash
kernel, causal over each request's new tokens (an 8k-token prompt of Llama-3.1-8B's shape on an H200: see
docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from disagg_worker.model.batch import ForwardBatch

if TYPE_CHECKING:
    from disagg_worker.model.triton_attention import PageTables


@dataclass(frozen=True)
class Span:
    """One request of an extend batch: its queries are rows start..start+n of q."""

    start: int
    n: int
    slots: torch.Tensor  # [seq_len] slots of the whole sequence
    mask: torch.Tensor | None  # [n, seq_len] offset causal mask; None when there is no cached prefix


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer's attention needs, derived once per forward from the batch."""

    out_slots: torch.Tensor  # [T] where the new tokens' K/V go
    decode_index: torch.Tensor | None  # decode only: [B, Lmax] slots, padded with slot 0
    decode_mask: torch.Tensor | None  # decode only: [B, 1, 1, Lmax], True where a key exists
    spans: tuple[Span, ...]  # extend only
    pages: PageTables | None = None  # CUDA only: the Triton kernels' page tables (see `triton_attention`)

    @property
    def fresh(self) -> bool:
        """An extend batch of prompts without a cached prefix: on CUDA its attention is SDPA's flash kernel per
        request (causal over the new tokens alone), faster there than the Triton extend kernel."""
        return bool(self.spans) and all(span.mask is None for span in self.spans)

    @classmethod
    def build(cls, batch: ForwardBatch, device: torch.device, page_size: int | None = None) -> AttentionPlan:
        """`page_size` (the pool's) lets a plan on CUDA hold page tables, so attention runs as Triton kernels."""
        batch = batch.to(device)
        if not batch.num_requests:  # an attention group without requests (DP attention): no attention runs
            return cls(batch.out_slots, None, None, ())
        plan = cls._build(batch, device)
        if device.type == "cuda" and page_size is not None:
            from disagg_worker.model.triton_attention import page_tables

            return replace(plan, pages=page_tables(batch, page_size, device))
        return plan

    @classmethod
    def _build(cls, batch: ForwardBatch, device: torch.device) -> AttentionPlan:
        if batch.is_decode:
            index = pad_sequence(list(batch.kv_slots), batch_first=True)
            lens = torch.tensor(batch.seq_lens, dtype=torch.long, device=device)
            mask = torch.arange(index.shape[1], device=device)[None, :] < lens[:, None]
            return cls(batch.out_slots, index, mask[:, None, None, :], ())
        spans: list[Span] = []
        start = 0
        for n, seq_len, slots in zip(batch.extend_lens, batch.seq_lens, batch.kv_slots, strict=True):
            causal = None if n == seq_len else _offset_causal_mask(n, seq_len, device)
            spans.append(Span(start, n, slots, causal))
            start += n
        return cls(batch.out_slots, None, None, tuple(spans))


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v ([T, H_kv, D]) at `slots` of pool buffers shaped [num_pages, page_size, H_kv, D]."""
    k_flat = flat_slots(k_buf)
    v_flat = flat_slots(v_buf)
    k_flat[slots] = k.to(k_flat.dtype)
    v_flat[slots] = v.to(v_flat.dtype)


def paged_attention(q: torch.Tensor, plan: AttentionPlan, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
    """Attention of q ([T, H, D]) over each request's cached sequence; returns [T, H, D].

    The new tokens' K/V must already be in the pool (see `write_kv`).
    """
    if plan.pages is not None and not plan.fresh:
        from disagg_worker.model.triton_attention import triton_paged_attention

        return triton_paged_attention(q, plan.pages, k_buf, v_buf)
    k_flat = flat_slots(k_buf)
    v_flat = flat_slots(v_buf)
    if plan.decode_index is not None:
        return _decode(q, plan.decode_index, plan.decode_mask, k_flat, v_flat)
    return _extend(q, plan, k_flat, v_flat)


def flat_slots(buf: torch.Tensor) -> torch.Tensor:
    """A pool buffer [num_pages, page_size, H, D] viewed as [slots, H, D]."""
    return buf.view(-1, buf.shape[-2], buf.shape[-1])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, H_kv, Lk, D] (any H_kv dividing H); mask None means causal with Lq == Lk."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    gqa = k.shape[1] != q.shape[1]
    if gqa and q.is_cuda:  # the flash kernel, not every version's `enable_gqa`: K/V heads repeated for the group
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


def gather_rows(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat[slots] for a slot tensor of any shape. `index_select` copies whole [H_kv, D] rows: on a CPU
    it gathers a decode batch's K/V 3-4x faster than advanced indexing, which copies element-wise."""
    return torch.index_select(flat, 0, slots.reshape(-1)).view(*slots.shape, *flat.shape[1:])


def _decode(
    q: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None, k_flat: torch.Tensor, v_flat: torch.Tensor
) -> torch.Tensor:
    k = gather_rows(k_flat, index).transpose(1, 2)  # [B, H_kv, Lmax, D]
    v = gather_rows(v_flat, index).transpose(1, 2)
    if q.dtype != torch.float32 and q.device.type == "cpu":
        return _decode_upcast(q, k, v, mask)
    out = _sdpa(q.unsqueeze(2), k, v, mask)  # q [B, H, 1, D]
    return out.squeeze(2)


def _decode_upcast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One query per request, q [B, H, D], against k/v [B, H_kv, L, D] in float32; query head i reads KV head
    i // (H / H_kv), as SDPA's `enable_gqa` does; returns [B, H, D] in q's dtype."""
    b, h, d = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    grouped = q.float().view(b, kv_heads, h // kv_heads, d)
    scores = torch.matmul(grouped, k.float().transpose(-1, -2)) * d**-0.5  # [B, H_kv, H / H_kv, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, length), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float())
    return out.view(b, h, d).to(q.dtype)


def _extend(q: torch.Tensor, plan: AttentionPlan, k_flat: torch.Tensor, v_flat: torch.Tensor) -> torch.Tensor:
    outs = []
    for span in plan.spans:
        q_i = q[span.start : span.start + span.n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        k_i = gather_rows(k_flat, span.slots).transpose(0, 1).unsqueeze(0)  # [1, H_kv, L, D]
        v_i = gather_rows(v_flat, span.slots).transpose(0, 1).unsqueeze(0)
        outs.append(_sdpa(q_i, k_i, v_i, span.mask)[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def _offset_causal_mask(n: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[n, seq_len] bool: query j (at position seq_len - n + j) sees keys 0..seq_len - n + j."""
    q_pos = torch.arange(n, device=device)[:, None] + (seq_len - n)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos
