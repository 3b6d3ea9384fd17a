"""Paged KV storage: one K and one V tensor per layer, indexed by page id.

Each buffer has shape `[num_pages, page_size, num_kv_heads, head_dim]` and is contiguous, so
page `p` occupies bytes `[p * page_nbytes, (p + 1) * page_nbytes)` of every buffer. The KV
transfer engine relies on this: it registers `buffers()` once and moves a run of pages as
one byte range per buffer.
"""

from __future__ import annotations

import torch


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
    ):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def buffers(self) -> list[torch.Tensor]:
        """All buffers in a fixed order: K of layers 0..L-1, then V of layers 0..L-1.

        Both ends of a KV transfer use this order to pair buffers, so it must not change.
        """
        return [*self._k, *self._v]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page in one buffer."""
        return _page_nbytes(self.page_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.num_pages * self.page_nbytes

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
    ) -> int:
        """How many pages fit in `budget_bytes` across all K and V buffers (rounded down)."""
        per_page = 2 * num_layers * _page_nbytes(page_size, num_kv_heads, head_dim, dtype)
        return max(0, int(budget_bytes) // per_page)


def _page_nbytes(page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return page_size * num_kv_heads * head_dim * itemsize
