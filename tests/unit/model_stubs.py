"""Stand-ins for the model tests: a KV pool with the real pool's interface, paged sequences, batches."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.config import ModelConfig

ARCHS = ("llama", "qwen2", "qwen3")


class StandInKV:
    """Same interface as the real pool: `k_buffer(layer)`, `v_buffer(layer)`, `page_size`."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32):
        self.page_size = page_size
        self.num_layers = cfg.num_layers
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self._k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[layer]


@dataclass
class PagedSeq:
    """A sequence whose tokens live on (non-contiguous) pages of the pool."""

    pages: list[int]
    tokens: list[int] = field(default_factory=list)

    def slots(self, start: int, end: int, page_size: int) -> torch.Tensor:
        return torch.tensor(
            [self.pages[p // page_size] * page_size + p % page_size for p in range(start, end)], dtype=torch.long
        )


class PageAllocator:
    """Hands out page ids in a shuffled order, so no sequence gets contiguous pages."""

    def __init__(self, num_pages: int, seed: int = 0):
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def new_seq(self, max_tokens: int, page_size: int) -> PagedSeq:
        n = -(-max_tokens // page_size)
        pages, self.free = self.free[:n], self.free[n:]
        return PagedSeq(pages=pages)


def make_batch(seqs: list[PagedSeq], new_ids: list[list[int]], page_size: int) -> ForwardBatch:
    """Append `new_ids[i]` to `seqs[i]` and describe that step as a ForwardBatch."""
    ids, positions, out_slots, extend_lens, seq_lens, kv_slots = [], [], [], [], [], []
    for seq, new in zip(seqs, new_ids, strict=True):
        start, end = len(seq.tokens), len(seq.tokens) + len(new)
        seq.tokens.extend(new)
        ids += new
        positions += range(start, end)
        out_slots.append(seq.slots(start, end, page_size))
        extend_lens.append(len(new))
        seq_lens.append(end)
        kv_slots.append(seq.slots(0, end, page_size))
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        out_slots=torch.cat(out_slots),
        extend_lens=extend_lens,
        seq_lens=seq_lens,
        kv_slots=kv_slots,
    )
