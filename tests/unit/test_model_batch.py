"""ForwardBatch: the derived views the model and the scheduler rely on."""

from __future__ import annotations

import torch

from disagg_worker.model.batch import ForwardBatch


def batch(extend_lens: list[int], seq_lens: list[int]) -> ForwardBatch:
    total = sum(extend_lens)
    return ForwardBatch(
        input_ids=torch.arange(total),
        positions=torch.cat([torch.arange(s - n, s) for n, s in zip(extend_lens, seq_lens, strict=True)]),
        out_slots=torch.arange(total),
        extend_lens=extend_lens,
        seq_lens=seq_lens,
        kv_slots=[torch.arange(s) for s in seq_lens],
    )


def test_logits_indices_point_at_each_requests_last_new_token():
    b = batch([3, 1, 5], [3, 10, 7])
    assert b.logits_indices.tolist() == [2, 3, 8]
    assert b.num_requests == 3 and b.num_tokens == 9
    assert not b.is_decode


def test_decode_batch():
    b = batch([1, 1], [4, 9])
    assert b.is_decode and b.logits_indices.tolist() == [0, 1]


def test_to_keeps_contents():
    b = batch([2, 1], [2, 6])
    moved = b.to("cpu")
    assert moved.extend_lens == b.extend_lens and moved.seq_lens == b.seq_lens
    assert torch.equal(moved.positions, b.positions) and all(
        torch.equal(x, y) for x, y in zip(moved.kv_slots, b.kv_slots, strict=True)
    )
