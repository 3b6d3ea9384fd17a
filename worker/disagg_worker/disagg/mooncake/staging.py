"""Staging for scattered pages: one large write instead of one write per page run.

Mooncake TCP costs ~35 us per write, so 1000 scattered pages move at a third of the speed of
one contiguous write of the same bytes. When decode's destination pages are fragmented it
reserves a range of its registered staging area for the room and names it in the
`RoomRequest`; prefill gathers the source pages of each send into its own registered staging
area (a memcpy) and writes them as one block per KV buffer, and decode scatters the block
into its pool before the room reports Success. Staged layout of a room with `n` destination
pages: decode buffer `b`, destination index `j` at byte `(b * n + j) * page_nbytes`.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.mooncake.engine import MooncakeEngine
from disagg_worker.disagg.runs import group_runs
from disagg_worker.tuning import TUNING

_ALIGN = 4096


def raw_bytes(ptr: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over memory owned elsewhere (a registered KV buffer); no copy."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


def worth_staging(dest_pages: list[int]) -> bool:
    """Stage when the destination is fragmented: many runs, short on average."""
    t = TUNING.transfer
    runs = len(group_runs(dest_pages, dest_pages))
    return runs >= t.staging_min_runs and runs * t.staging_max_avg_run_pages > len(dest_pages)


def _as_pages(pool: torch.Tensor, block: torch.Tensor, page_nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both uint8 tensors as rows of one page; 8-byte elements copy rows several times faster."""
    pool = pool[: pool.numel() // page_nbytes * page_nbytes]
    if page_nbytes % 8 == 0 and pool.data_ptr() % 8 == 0 and block.data_ptr() % 8 == 0:
        pool, block, page_nbytes = pool.view(torch.int64), block.view(torch.int64), page_nbytes // 8
    return pool.view(-1, page_nbytes), block.view(-1, page_nbytes)


def gather(buffer: torch.Tensor, page_nbytes: int, pages: list[int], out: torch.Tensor) -> None:
    """Copy `pages` of `buffer` (uint8) into `out` (uint8, len(pages) pages), in order."""
    src, dst = _as_pages(buffer, out, page_nbytes)
    torch.index_select(src, 0, torch.tensor(pages, dtype=torch.int64, device=src.device), out=dst)


def scatter(block: torch.Tensor, page_nbytes: int, buffer: torch.Tensor, pages: list[int]) -> None:
    """Copy page `k` of `block` (uint8) to page `pages[k]` of `buffer` (uint8)."""
    dst, src = _as_pages(buffer, block, page_nbytes)
    dst.index_copy_(0, torch.tensor(pages, dtype=torch.int64, device=dst.device), src)


class StagingArea:
    """A byte region (registered with the transfer engine by its owner) handed out in
    aligned ranges, first fit, on the KV pool's device (staging copies run there). Thread-safe."""

    def __init__(self, nbytes: int = TUNING.transfer.staging_nbytes, device: torch.device | str = "cpu"):
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, nbytes), sorted by offset
        self._lock = threading.Lock()

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def alloc(self, nbytes: int) -> int:
        """Offset of a free range of at least `nbytes`, or -1 when none is free."""
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            for i, (off, n) in enumerate(self._free):
                if n >= size:
                    self._free[i : i + 1] = [(off + size, n - size)] if n > size else []
                    return off
        return -1

    def free(self, offset: int, nbytes: int) -> None:
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            self._free.append((offset, size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free = merged

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]


def open_registered(cfg: DisaggConfig, layout: KVLayout) -> tuple[MooncakeEngine, list[torch.Tensor], StagingArea]:
    """A transfer engine with the KV buffers and a fresh staging area registered once, plus byte
    views of the KV buffers (for gathering and scattering staged rooms), on the pool's device: the
    layout's own tensors; raw views of its addresses only for a layout made of host addresses. Both
    managers start so."""
    engine = MooncakeEngine(cfg.advertise_host, cfg.transfer_protocol, cfg.ib_device)
    buffers = list(zip(layout.buffer_ptrs, layout.buffer_nbytes, strict=True))
    for ptr, n in buffers:
        engine.register(ptr, n)
    views = list(layout.buffers) if layout.buffers else [raw_bytes(ptr, n) for ptr, n in buffers]
    staging = StagingArea(device=views[0].device if views else "cpu")
    engine.register(staging.ptr, staging.nbytes)
    return engine, views, staging
