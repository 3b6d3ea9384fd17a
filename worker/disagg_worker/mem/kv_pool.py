"""Paged KV storage, indexed by page id, in one of two layouts (`KVKind`):

- MHA: one K and one V buffer per layer, each `[num_pages, page_size, num_kv_heads, head_dim]`
  (grouped-query attention: the rank's KV heads);
- MLA: one latent buffer per layer, `[num_pages, page_size, 1, latent_dim]` (DeepSeek's compressed
  KV plus its shared rotary key; `num_kv_heads` is 1 and `head_dim` the latent width).

Every buffer is contiguous, so page `p` occupies bytes `[p * page_nbytes, (p + 1) * page_nbytes)` of
each. The KV transfer engine relies on this: it registers `buffers()` once and moves a run of pages
as one byte range per buffer.

On a CPU the buffers are views of one anonymous memory map: its pages read as zero and become resident
only when written, so a pool costs the memory of the pages it has used, not of its capacity (SmolLM2's
default 16384 tokens are 377 MB in bfloat16; `torch.zeros` writes, and so holds, all of it from the start).
"""

from __future__ import annotations

import math
import mmap
from enum import Enum

import torch


class KVKind(str, Enum):
    MHA = "mha"
    MLA = "mla"

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self is KVKind.MHA else 1


def _zeroed(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """`count` zeroed tensors of `shape`; on a CPU views of one anonymous map (resident where written)."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    # Private: unwritten pages read as the kernel's zero page (a shared map would make them resident on read).
    region = torch.frombuffer(
        mmap.mmap(-1, nbytes * count, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8
    )
    return [region[i * nbytes : (i + 1) * nbytes].view(dtype).view(shape) for i in range(count)]


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        kind: KVKind = KVKind.MHA,
    ):
        if kind is KVKind.MLA and num_kv_heads != 1:
            raise ValueError(f"an MLA pool holds one latent per token, not {num_kv_heads} heads")
        self.kind = kind
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        per_layer = kind.buffers_per_layer
        flat = _zeroed(num_layers * per_layer, shape, dtype, self.device)
        # Per layer: [K, V] (MHA) or [latent] (MLA).
        self._bufs = [flat[i * per_layer : (i + 1) * per_layer] for i in range(num_layers)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._of(KVKind.MHA, layer)[0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._of(KVKind.MHA, layer)[1]

    def latent_buffer(self, layer: int) -> torch.Tensor:
        return self._of(KVKind.MLA, layer)[0]

    def _of(self, kind: KVKind, layer: int) -> list[torch.Tensor]:
        if self.kind is not kind:
            raise TypeError(f"a {self.kind.value} KV pool has no {kind.value} buffers")
        return self._bufs[layer]

    def buffers(self) -> list[torch.Tensor]:
        """All buffers in a fixed order: K of layers 0..L-1, then V of layers 0..L-1 (MHA); the latent
        of layers 0..L-1 (MLA).

        Both ends of a KV transfer use this order to pair buffers, so it must not change.
        """
        return [layer[i] for i in range(self.kind.buffers_per_layer) for layer in self._bufs]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page in one buffer."""
        return _page_nbytes(self.page_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def nbytes_per_page(self) -> int:
        """Bytes one page costs over every buffer (what a page of capacity takes from the device)."""
        return self.kind.buffers_per_layer * self.num_layers * self.page_nbytes

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.nbytes_per_page

    def page_bytes(self, pages: list[int]) -> bytes:
        """The bytes of `pages`, in the given order, concatenated over `buffers()` (for tests
        that check two pools hold byte-identical KV)."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        chunks = [buf.index_select(0, index).contiguous().view(torch.uint8).cpu() for buf in self.buffers()]
        return b"".join(c.numpy().tobytes() for c in chunks)

    @staticmethod
    def pages_for_memory(
        budget_bytes: int,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kind: KVKind = KVKind.MHA,
    ) -> int:
        """How many pages fit in `budget_bytes` across all buffers (rounded down)."""
        per_page = kind.buffers_per_layer * num_layers * _page_nbytes(page_size, num_kv_heads, head_dim, dtype)
        return max(0, int(budget_bytes) // per_page)


def _page_nbytes(page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return page_size * num_kv_heads * head_dim * itemsize
