"""Head slices: writing part of a page's KV heads when prefill and decode ranks hold different heads.

A page is laid out `[page_size, heads, head_bytes]`, so the bytes of some of its heads are
`page_size` pieces, one per token, not one range. When decode holds fewer heads than a prefill
rank (decode TP > prefill TP) the source pieces are scattered; when it holds more (decode TP <
prefill TP) the destination pieces are. Writing each piece on its own would be one Mooncake write
per token per page per buffer: a 1024-token request of a 32-layer model would be 65536 writes of
a few hundred bytes, and a Mooncake TCP write costs ~35 us whatever its size (over 2 s). Instead
the slice travels as whole "slice pages" (`[page_size, count, head_bytes]`, contiguous):
- a scattered source is gathered into prefill's registered staging area (a strided copy, about
  as fast as a memcpy of the same bytes) and written from there, one block per buffer;
- a scattered destination gets a range of decode's registered staging area, named in the
  `RoomRequest`; prefill writes slice pages there and decode scatters them into its pool before
  the room reports Success, as it does for fragmented rooms (`staging`).
So a head-sliced send costs as many writes as a whole-page send of the same pages. Only when a
staging area is full do the pieces travel one token at a time: correct, but 10-25x slower per byte
(0.077 GB/s: a 128 MiB room, TP 2 -> 1, took 1.7 s; bench/README.md), so decode logs it.

Staged layout of a sliced room with `n` destination pages: decode buffer `b`, destination index
`j` at byte `(b * n + j) * slice_page_nbytes` of its range.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.mapping import Target
from disagg_worker.disagg.mooncake.staging import scatter, worth_staging
from disagg_worker.disagg.runs import group_runs

log = logging.getLogger(__name__)
Write = tuple[int, int, int]  # (src address, dst address, nbytes)
_WARN_EVERY_S = 10.0
_warned = [0.0]  # when decode last logged a slice written token by token


@dataclass(frozen=True)
class SliceSide:
    """Where one side keeps a slice: token `t` of slice page `k` of buffer `i` starts at byte
    `bases[i] + index[k] * page_stride + t * token_stride + offset`."""

    bases: list[int]
    index: list[int]
    page_stride: int
    token_stride: int
    offset: int = 0

    def contiguous(self, page_size: int, token_nbytes: int) -> bool:
        """Each slice page is one byte range, and consecutive indices follow each other."""
        return self.token_stride == token_nbytes and self.offset == 0 and self.page_stride == page_size * token_nbytes


def slice_writes(src: SliceSide, dst: SliceSide, page_size: int, token_nbytes: int) -> list[Write]:
    """The writes that copy slice pages `src.index[k] -> dst.index[k]` of every buffer: one per
    run of consecutive pages when both sides keep slice pages whole, else one per token."""
    if len(src.index) != len(dst.index) or len(src.bases) != len(dst.bases):
        raise ValueError("source and destination differ in pages or buffers")
    page = page_size * token_nbytes
    if src.contiguous(page_size, token_nbytes) and dst.contiguous(page_size, token_nbytes):
        runs = group_runs(src.index, dst.index)
        return [
            (sb + s * src.page_stride, db + d * dst.page_stride, n * page)
            for s, d, n in runs
            for sb, db in zip(src.bases, dst.bases, strict=True)
        ]
    return [
        (
            sb + s * src.page_stride + t * src.token_stride + src.offset,
            db + d * dst.page_stride + t * dst.token_stride + dst.offset,
            token_nbytes,
        )
        for s, d in zip(src.index, dst.index, strict=True)
        for t in range(page_size)
        for sb, db in zip(src.bases, dst.bases, strict=True)
    ]


@dataclass(frozen=True)
class PageShape:
    """A KV page: `page_size` tokens of `num_heads` heads of `head_nbytes` bytes."""

    page_size: int
    num_heads: int
    head_nbytes: int

    def slice_nbytes(self, count: int) -> int:
        return self.page_size * count * self.head_nbytes


def _views(pool: torch.Tensor, block: torch.Tensor, shape: PageShape, first: int, count: int):
    """Heads `[first, first + count)` of a uint8 pool as `[pages, page_size, count * head]`, and a
    uint8 block of slice pages as the same shape (8-byte elements when both are aligned: row
    copies run several times faster)."""
    page = shape.page_size * shape.num_heads * shape.head_nbytes
    pool = pool[: pool.numel() // page * page]
    head = shape.head_nbytes
    if head % 8 == 0 and pool.data_ptr() % 8 == 0 and block.data_ptr() % 8 == 0:
        pool, block, head = pool.view(torch.int64), block.view(torch.int64), head // 8
    heads = pool.view(-1, shape.page_size, shape.num_heads * head)[:, :, first * head : (first + count) * head]
    return heads, block.view(-1, shape.page_size, count * head)


def _few_runs(pages: list[int]) -> list[tuple[int, int, int]] | None:
    """`pages` as (first page, index in the block, n) runs when there are few: one strided copy per
    run beats a gather by index (1.1-1.8x here); many short runs go by index."""
    runs = group_runs(pages, list(range(len(pages))))
    return runs if len(runs) <= _MAX_RUN_COPIES else None


_MAX_RUN_COPIES = 4


def gather_heads(pool: torch.Tensor, shape: PageShape, first: int, count: int, pages: list[int], out: torch.Tensor):
    """Copy heads `[first, first + count)` of `pages` of `pool` (uint8) into `out` (uint8,
    `len(pages)` slice pages), in order."""
    src, dst = _views(pool, out, shape, first, count)
    runs = _few_runs(pages)
    if runs is None:
        torch.index_select(src, 0, torch.tensor(pages, dtype=torch.int64, device=src.device), out=dst)
        return
    for p, k, n in runs:
        dst[k : k + n].copy_(src[p : p + n])


def scatter_heads(block: torch.Tensor, shape: PageShape, first: int, count: int, pool: torch.Tensor, pages: list[int]):
    """Copy slice page `k` of `block` (uint8) to heads `[first, first + count)` of page `pages[k]`
    of `pool` (uint8)."""
    dst, src = _views(pool, block, shape, first, count)
    runs = _few_runs(pages)
    if runs is None:
        dst.index_copy_(0, torch.tensor(pages, dtype=torch.int64, device=dst.device), src)
        return
    for p, k, n in runs:
        dst[p : p + n].copy_(src[k : k + n])


@dataclass(frozen=True)
class StagedRange:
    """A range of decode's staging area where a room's KV lands before it is scattered into its
    pages: whole pages (`heads` None) or the slice `(first, count)` of decode's heads."""

    offset: int
    nbytes: int
    heads: tuple[int, int] | None


def reserve_staging(
    targets: list[Target], layout: KVLayout, dest_pages: list[int], alloc: Callable[[int], int]
) -> tuple[list[int], list[StagedRange]]:
    """Decode: the staging offset each target writes a room at (-1: in place), and the ranges
    reserved with `alloc` (nbytes -> offset, -1 when full). A head slice that is part of decode's
    heads gets a range, shared by the stages that write it; whole pages get one when the destination
    is fragmented. What finds no room is written in place."""
    fragmented = worth_staging(dest_pages)
    ranges: dict[tuple[int, int] | None, int] = {}
    staged: list[StagedRange] = []
    offsets = []
    for t in targets:
        whole = t.heads.count == layout.num_kv_heads
        if t.heads.count == 0 or (whole and not fragmented):
            offsets.append(-1)
            continue
        key = None if whole else (t.heads.dst, t.heads.count)
        if key not in ranges:
            slice_page = layout.page_size * t.heads.count * layout.head_nbytes
            nbytes = len(dest_pages) * slice_page * len(layout.buffer_ptrs)
            ranges[key] = alloc(nbytes)
            if ranges[key] >= 0:
                staged.append(StagedRange(ranges[key], nbytes, key))
            elif key is not None and time.monotonic() - _warned[0] > _WARN_EVERY_S:
                _warned[0] = time.monotonic()
                log.warning(
                    "a head slice of %d MiB found no room in the staging area: written token by token (slow)",
                    nbytes >> 20,
                )
        offsets.append(ranges[key])
    return offsets, staged


def unstage(
    area: torch.Tensor, staged: StagedRange, layout: KVLayout, buffers: list[torch.Tensor], dest_pages: list[int]
) -> None:
    """Decode: scatter a staged range (`area`, uint8) into `dest_pages` of `buffers` (uint8 views of
    the layout's buffers)."""
    block = staged.nbytes // len(buffers)
    shape = PageShape(layout.page_size, layout.num_kv_heads, layout.head_nbytes)
    for b, buf in enumerate(buffers):
        view = area[b * block : (b + 1) * block]
        if staged.heads is None:
            scatter(view, layout.page_nbytes, buf, dest_pages)
        else:
            scatter_heads(view, shape, *staged.heads, buf, dest_pages)
