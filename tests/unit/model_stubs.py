"""Stand-ins for the model tests: a KV pool with the real pool's interface, paged sequences, batches."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from disagg_worker.mem.kv_pool import KVKind, KVPool
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.config import ModelConfig

# The families GGUF files are read for, and the MoE ones (MLA for DeepSeek-V3) read from safetensors only.
DENSE_ARCHS = ("llama", "qwen2", "qwen3")
ARCHS = (*DENSE_ARCHS, "qwen3_moe", "deepseek_v3")


def model_pool(cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32) -> KVPool:
    """The real pool, holding every layer and KV head of `cfg` (per-head K/V, or MLA's latent)."""
    kind = KVKind.MLA if cfg.mla else KVKind.MHA
    return KVPool(cfg.num_layers, num_pages, page_size, cfg.kv_num_heads, cfg.kv_head_dim, dtype, kind=kind)


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
