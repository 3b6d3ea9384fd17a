"""The cases of test_triton_attention.py, run by `python -m tests.unit.triton_interpreted` with TRITON_INTERPRET=1.

Triton decides between compiling and interpreting when `@triton.jit` decorates a function, its own library
functions (`tl.max`, `tl.cdiv`, ...) included, so TRITON_INTERPRET must be set before triton is first imported;
in a pytest process something may have imported it already. Here the kernel module is imported only inside
the cases, in a process of their own. Each case compares the kernels with the torch path
(`attention.paged_attention`) in float32, within atol 1e-4 and rtol 1e-4, and returns the largest difference;
`main` prints every case's result as one JSON line. Pools are random, pages handed out shuffled.
"""

from __future__ import annotations

import json
import os
import traceback
from dataclasses import replace
from functools import partial

import torch

from disagg_worker.model.attention import AttentionPlan, paged_attention
from disagg_worker.model.batch import ForwardBatch
from tests.unit.model_stubs import PageAllocator

NUM_PAGES, KV_HEADS, HEAD_DIM = 64, 2, 32
TOL = dict(atol=1e-4, rtol=1e-4)


def pool(page_size: int, seed: int, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_PAGES, page_size, KV_HEADS, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def batch_of(plan: list[tuple[int, int]], page_size: int, seed: int) -> ForwardBatch:
    """plan: per request (cached tokens, new tokens), each sequence on shuffled pages of the pool."""
    alloc = PageAllocator(NUM_PAGES, seed=seed)
    seqs = [alloc.new_seq(cached + new, page_size) for cached, new in plan]
    return ForwardBatch(
        input_ids=torch.zeros(sum(new for _, new in plan), dtype=torch.long),
        positions=torch.cat([torch.arange(cached, cached + new) for cached, new in plan]),
        out_slots=torch.cat([s.slots(c, c + n, page_size) for s, (c, n) in zip(seqs, plan, strict=True)]),
        extend_lens=[new for _, new in plan],
        seq_lens=[cached + new for cached, new in plan],
        kv_slots=[s.slots(0, c + n, page_size) for s, (c, n) in zip(seqs, plan, strict=True)],
    )


def compare(plan, page_size: int, group: int, head_dim: int = HEAD_DIM, num_splits: int | None = None) -> float:
    """The kernels' output and the torch path's for one random batch; returns the largest difference."""
    from disagg_worker.model import triton_attention as kernels

    seed = len(plan) * 100 + page_size + group
    k_buf, v_buf = pool(page_size, seed, head_dim)
    batch = batch_of(plan, page_size, seed)
    q = torch.randn(batch.num_tokens, KV_HEADS * group, head_dim, generator=torch.Generator().manual_seed(seed))
    expected = paged_attention(q, AttentionPlan.build(batch, q.device), k_buf, v_buf)
    tables = kernels.page_tables(batch, page_size, q.device)
    if tables.is_decode:
        got = kernels.decode_attention(q, k_buf, v_buf, tables.pages, tables.seq_lens, head_dim**-0.5, num_splits)
    else:
        got = kernels.triton_paged_attention(q, tables, k_buf, v_buf)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, **TOL)
    return float((got - expected).abs().max())


def interpreted() -> float:
    from triton.runtime.interpreter import InterpretedFunction

    from disagg_worker.model import triton_attention as kernels

    for kernel in (kernels._decode_split_kernel, kernels._decode_merge_kernel, kernels._extend_kernel):
        assert isinstance(kernel, InterpretedFunction), type(kernel)
    return 0.0


def page_tables_in_order() -> float:
    from disagg_worker.model.triton_attention import page_tables

    tables = page_tables(batch_of([(30, 1), (0, 17)], 16, seed=3), 16, torch.device("cpu"))
    alloc = PageAllocator(NUM_PAGES, seed=3)
    first, second = alloc.new_seq(31, 16).pages, alloc.new_seq(17, 16).pages
    assert tables.pages.dtype == torch.int32 and tables.pages.tolist() == [first, second]
    assert tables.seq_lens.tolist() == [31, 17] and tables.q_starts.tolist() == [0, 1]
    assert tables.q_lens.tolist() == [1, 17] and (tables.max_seq_len, tables.max_q_len) == (31, 17)
    return 0.0


def dispatch() -> float:
    """What CUDA does, on the CPU: a plan holding page tables makes `paged_attention` run the kernels."""
    from disagg_worker.model import triton_attention as kernels

    calls = []
    original = kernels.triton_paged_attention
    kernels.triton_paged_attention = lambda *args: calls.append(1) or original(*args)
    k_buf, v_buf = pool(16, seed=5)
    worst = 0.0
    try:
        for plan in ([(40, 23), (0, 9)], [(33, 1), (70, 1)]):
            batch = batch_of(plan, 16, seed=5)
            q = torch.randn(batch.num_tokens, KV_HEADS * 4, HEAD_DIM)
            torch_plan = AttentionPlan.build(batch, q.device)
            got = paged_attention(q, replace(torch_plan, pages=kernels.page_tables(batch, 16, q.device)), k_buf, v_buf)
            expected = paged_attention(q, torch_plan, k_buf, v_buf)
            torch.testing.assert_close(got, expected, **TOL)
            worst = max(worst, float((got - expected).abs().max()))
    finally:
        kernels.triton_paged_attention = original
    assert len(calls) == 2
    return worst


DECODES = {"one request": [(149, 1)], "three requests": [(149, 1), (36, 1), (200, 1)]}
EXTENDS = {
    "prefill of two": [(0, 70), (0, 9)],
    "chunks over cached prefixes": [(40, 23), (100, 50)],
    "prefill beside a decode": [(0, 33), (57, 1)],
}
GROUPS = {"mha": 1, "gqa4": 4}

# Decode: lengths off the page size, four splits (with 64-token pages a 150-token request leaves one empty).
CASES = {
    "interpreted": interpreted,
    "page tables": page_tables_in_order,
    **{
        f"decode {name} {g}-{ps}": partial(compare, plan, ps, group, num_splits=4)
        for name, plan in DECODES.items()
        for g, group in GROUPS.items()
        for ps in (16, 64)
    },
    **{f"decode head_dim {d} default splits": partial(compare, [(300, 1), (5, 1)], 16, 4, d) for d in (64, 128)},
    "decode one split": partial(compare, [(149, 1), (36, 1)], 16, 4, num_splits=1),
    **{f"decode whole pages {ps}": partial(compare, [(63, 1), (127, 1)], ps, 4, num_splits=2) for ps in (16, 64)},
    **{
        f"extend {name} {g}-{ps}": partial(compare, plan, ps, group)
        for name, plan in EXTENDS.items()
        for g, group in GROUPS.items()
        for ps in (16, 64)
    },
    "extend head_dim 128": partial(compare, [(20, 45)], 16, 4, 128),
    "dispatch": dispatch,
}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, case in CASES.items():
        try:
            results[name] = {"max_error": case()}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
