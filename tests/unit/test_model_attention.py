"""Paged attention equals plain attention over each request's contiguous history."""

from __future__ import annotations

import pytest
import torch

from disagg_worker.model.attention import AttentionPlan, paged_attention, write_kv
from disagg_worker.model.batch import ForwardBatch
from tests.unit.model_stubs import PageAllocator, PagedSeq

PAGE_SIZE, NUM_PAGES, H, H_KV, D = 4, 40, 4, 2, 16


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_new: int) -> torch.Tensor:
    """float64 softmax attention of the last n_new queries over all L keys; q [n, H, D], k/v [L, H_kv, D]."""
    q, k, v = q.double(), k.double().repeat_interleave(H // H_KV, 1), v.double().repeat_interleave(H // H_KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    offset = k.shape[0] - n_new
    mask = torch.arange(k.shape[0])[None, :] > (torch.arange(n_new)[:, None] + offset)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_step(plan: list[tuple[int, int]], q_dtype: torch.dtype, kv_dtype: torch.dtype):
    """plan: per request (cached tokens, new tokens). Returns paged output and the reference."""
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_PAGES, PAGE_SIZE, H_KV, D)
    k_buf, v_buf = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    alloc = PageAllocator(NUM_PAGES, seed=4)
    seqs = [alloc.new_seq(cached + new, PAGE_SIZE) for cached, new in plan]
    histories = []
    for seq, (cached, _) in zip(seqs, plan, strict=True):
        k, v = torch.randn(cached, H_KV, D, generator=gen), torch.randn(cached, H_KV, D, generator=gen)
        write_kv(k_buf, v_buf, k, v, seq.slots(0, cached, PAGE_SIZE))
        histories.append((k, v))
    total = sum(new for _, new in plan)
    q = torch.randn(total, H, D, generator=gen).to(q_dtype)
    k_new, v_new = torch.randn(total, H_KV, D, generator=gen), torch.randn(total, H_KV, D, generator=gen)
    batch = batch_for(seqs, plan)
    write_kv(k_buf, v_buf, k_new.to(q_dtype), v_new.to(q_dtype), batch.out_slots)
    out = paged_attention(q, AttentionPlan.build(batch, q.device), k_buf, v_buf)
    expected, start = [], 0
    for (k, v), (_, new) in zip(histories, plan, strict=True):
        sl = slice(start, start + new)
        expected.append(reference(q[sl], torch.cat([k, k_new[sl]]), torch.cat([v, v_new[sl]]), new))
        start += new
    return out, torch.cat(expected)


def batch_for(seqs: list[PagedSeq], plan: list[tuple[int, int]]) -> ForwardBatch:
    slots = [seq.slots(cached, cached + new, PAGE_SIZE) for seq, (cached, new) in zip(seqs, plan, strict=True)]
    return ForwardBatch(
        input_ids=torch.zeros(sum(new for _, new in plan), dtype=torch.long),
        positions=torch.cat([torch.arange(cached, cached + new) for cached, new in plan]),
        out_slots=torch.cat(slots),
        extend_lens=[new for _, new in plan],
        seq_lens=[cached + new for cached, new in plan],
        kv_slots=[seq.slots(0, cached + new, PAGE_SIZE) for seq, (cached, new) in zip(seqs, plan, strict=True)],
    )


PLANS = {
    "decode of different lengths": [(9, 1), (0, 1), (22, 1), (3, 1)],
    "mixed prefill, chunk and decode": [(0, 7), (10, 5), (13, 1)],
    "one long prefill": [(0, 40)],
}


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_float32_paged_attention_matches_reference(plan):
    out, expected = run_step(plan, torch.float32, torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_paged_attention_matches_reference(plan, kv_dtype):
    out, expected = run_step(plan, torch.bfloat16, kv_dtype)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=0)


def test_write_kv_puts_each_token_at_its_page_and_offset():
    k_buf, v_buf = torch.zeros(NUM_PAGES, PAGE_SIZE, H_KV, D), torch.zeros(NUM_PAGES, PAGE_SIZE, H_KV, D)
    k, v = torch.randn(3, H_KV, D), torch.randn(3, H_KV, D)
    write_kv(k_buf, v_buf, k, v, torch.tensor([5 * PAGE_SIZE + 3, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1]))
    assert torch.equal(k_buf[5, 3], k[0]) and torch.equal(k_buf[2, 0], k[1]) and torch.equal(v_buf[2, 1], v[2])
    assert int((k_buf != 0).any(-1).any(-1).sum()) == 3


@pytest.mark.parametrize(
    "plan, kernels", [([(0, 30), (0, 7)], False), ([(5, 30), (0, 7)], True), ([(40, 1), (9, 1)], True)]
)
def test_with_page_tables_only_prompts_with_a_cached_prefix_or_decodes_go_to_the_triton_kernels(
    monkeypatch, plan, kernels
):
    """On CUDA a plan holds page tables; prompts without a cached prefix still take SDPA's path (its flash kernel
    there), every other batch the Triton kernels (built here on CPU tensors, the kernels replaced by a marker)."""
    from dataclasses import replace

    from disagg_worker.model import triton_attention
    from tests.unit.triton_interpreted import HEAD_DIM, KV_HEADS, batch_of, pool

    k_buf, v_buf = pool(16, seed=3)
    batch = batch_of(plan, 16, seed=3)
    q = torch.randn(batch.num_tokens, KV_HEADS * 2, HEAD_DIM)
    torch_plan = AttentionPlan.build(batch, q.device)
    cuda_like = replace(torch_plan, pages=triton_attention.page_tables(batch, 16, q.device))
    monkeypatch.setattr(triton_attention, "triton_paged_attention", lambda *a: "kernels")
    got = paged_attention(q, cuda_like, k_buf, v_buf)
    if kernels:
        assert isinstance(got, str) and got == "kernels"
    else:
        assert torch.equal(got, paged_attention(q, torch_plan, k_buf, v_buf))
