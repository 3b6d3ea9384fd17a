"""Head-slice writes end to end without a network: the mapping's targets, decode's staging ranges,
prefill's planned writes (carried out here with memmove between real KV pools) and decode's
scatter leave every decode rank's pool holding exactly its heads of the prefill pages, for TP
ratios in both directions, replicated heads, chunked sends, and full staging areas."""

from __future__ import annotations

import ctypes
from typing import cast

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg import KVLayout
from disagg_worker.disagg.mapping import check_compatible
from disagg_worker.disagg.messages import DecodeHello, RoomRequest
from disagg_worker.disagg.mooncake.engine import MooncakeEngine
from disagg_worker.disagg.mooncake.peers import DecodePeer
from disagg_worker.disagg.mooncake.prefill_room import PrefillRoom, SendJob
from disagg_worker.disagg.mooncake.prefill_writes import PrefillWrites
from disagg_worker.disagg.mooncake.slices import PageShape, SliceSide, reserve_staging, slice_writes, unstage
from disagg_worker.disagg.mooncake.staging import StagingArea, raw_bytes
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.model.parallel import Shard
from tests.unit.test_transfer_heads import model, prefill_topology

PAGES, PAGE_SIZE, HEAD_DIM = 16, 4, 4  # float32: 16-byte heads, as prefill_topology registers them
LAYERS = 2


def reference(kv_heads: int) -> list[torch.Tensor]:
    """The model's K and V of every layer, all heads: what every rank's pool is a slice of."""
    g = torch.Generator().manual_seed(kv_heads)
    return [torch.randn(PAGES, PAGE_SIZE, kv_heads, HEAD_DIM, generator=g) for _ in range(2 * LAYERS)]


def rank_pool(ref: list[torch.Tensor] | None, heads: range) -> tuple[KVPool, KVLayout]:
    pool = KVPool(LAYERS, PAGES, PAGE_SIZE, len(heads), HEAD_DIM, torch.float32)
    if ref is not None:
        for buf, full in zip(pool.buffers(), ref, strict=True):
            buf.copy_(full[:, :, heads.start : heads.stop])
    return pool, KVLayout.from_pool(pool, "float32", kv_heads=heads)


def run_room(tp_p, tp_d, kv, src, dst, chunks, prefill_staging, decode_staging) -> None:
    m = model(kv, LAYERS)
    ref = reference(kv)
    prefill = [rank_pool(ref, Shard(tp_rank=t, tp_size=tp_p).kv_heads(m)) for t in range(tp_p)]
    topo = prefill_topology(m, tp_p, 1)
    for d in range(tp_d):
        heads = Shard(tp_rank=d, tp_size=tp_d).kv_heads(m)
        pool, lay = rank_pool(None, heads)
        targets, err = check_compatible(topo, DisaggConfig(role=Role.DECODE, tp_size=tp_d), lay, d, 0)
        assert not err, err
        area = StagingArea(decode_staging)
        offsets, staged = reserve_staging(targets, lay, dst, area.alloc)
        hello = DecodeHello(
            decode_id=f"d{d}",
            reply_endpoint="e",
            session_id="s",
            buffer_ptrs=lay.buffer_ptrs,
            buffer_nbytes=lay.buffer_nbytes,
            page_nbytes=lay.page_nbytes,
            start_layer=0,
            aux_item_nbytes=16,
            staging_ptr=area.ptr,
            staging_nbytes=area.nbytes,
            num_kv_heads=lay.num_kv_heads,
            head_nbytes=lay.head_nbytes,
        )
        for t, offset in zip(targets, offsets, strict=True):
            req = RoomRequest(
                decode_id=f"d{d}",
                reply_endpoint="e",
                room=1,
                dest_pages=dst,
                aux_slot=0,
                staging_offset=offset,
                src_head=t.heads.src,
                dst_head=t.heads.dst,
                num_heads=-1 if t.whole else t.heads.count,
                decode_ranks=t.decode_ranks,
            )
            _, src_layout = prefill[t.tp_rank]
            peer = DecodePeer.from_hello(hello, src_layout)
            assert not peer.error and not peer.check_dest(req, src_layout)
            send_chunks(src_layout, peer, req, src, chunks, StagingArea(prefill_staging))
        for r in staged:
            unstage(
                area.view(r.offset, r.nbytes),
                r,
                lay,
                [raw_bytes(p, n) for p, n in zip(lay.buffer_ptrs, lay.buffer_nbytes, strict=True)],
                dst,
            )
        for buf, full in zip(pool.buffers(), ref, strict=True):
            want = torch.zeros_like(buf)
            want[dst] = full[src][:, :, heads.start : heads.stop]
            assert torch.equal(buf, want), f"decode rank {d} of {tp_d} (prefill TP {tp_p}, {kv} KV heads)"


def send_chunks(lay: KVLayout, peer: DecodePeer, req: RoomRequest, src: list[int], chunks: list[int], area) -> None:
    """Plan each chunk's writes as prefill's transfer thread does and carry them out with memmove."""
    buffers = [raw_bytes(p, n) for p, n in zip(lay.buffer_ptrs, lay.buffer_nbytes, strict=True)]
    writes = PrefillWrites(cast(MooncakeEngine, None), lay, buffers, area, print, print, print)
    room, first = PrefillRoom(req.room), 0
    for n in chunks:
        job = SendJob(
            room=room,
            peer=peer,
            request=req,
            src_pages=src[first : first + n],
            dst_pages=req.dest_pages[first : first + n],
            last=False,
            first=False,
            first_index=first,
        )
        for s, d, nbytes in writes._plan(job):
            ctypes.memmove(d, s, nbytes)
        if job.staged is not None:
            area.free(*job.staged)
        first += n


MAPPINGS = [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 1, 1), (1, 2, 1), (2, 2, 2), (4, 1, 2), (1, 4, 4), (2, 4, 2)]


@settings(max_examples=120, deadline=None)
@given(
    mapping=st.sampled_from(MAPPINGS),
    pages=st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.permutations(range(PAGES)).map(lambda p: p[:n]),
            st.one_of(st.just(list(range(3, 3 + n))), st.permutations(range(PAGES)).map(lambda p: p[:n])),
            st.lists(st.integers(1, n), min_size=1, max_size=3),
        )
    ),
    prefill_staging=st.sampled_from([0, 1 << 20]),
    decode_staging=st.sampled_from([0, 1 << 20]),
)
def test_every_decode_rank_gets_exactly_its_heads_of_the_prefill_pages(mapping, pages, prefill_staging, decode_staging):
    src, dst, cuts = pages
    chunks, left = [], len(src)
    for c in cuts:  # chunked prefill: sends of these sizes, the rest in a last one
        if left > c:
            chunks.append(c)
            left -= c
    tp_p, tp_d, kv = mapping
    run_room(tp_p, tp_d, kv, list(src), list(dst), [*chunks, left], prefill_staging, decode_staging)


def test_a_sliced_send_is_as_few_writes_as_a_whole_page_send():
    """Decode holding 2 heads of prefill's 4, contiguous pages: one write per buffer through staging,
    as a whole-page send; without staging one per token per page per buffer."""
    shape = PageShape(PAGE_SIZE, 4, 16)
    token = 2 * 16
    src = SliceSide([0, 1 << 30], list(range(8)), PAGE_SIZE * 4 * 16, 4 * 16, 2 * 16)
    gathered = SliceSide([0, 1 << 30], list(range(8)), shape.slice_nbytes(2), token)
    dst = SliceSide([1 << 40, 1 << 41], list(range(20, 28)), shape.slice_nbytes(2) * 1, token)
    assert len(slice_writes(gathered, dst, PAGE_SIZE, token)) == 2
    assert len(slice_writes(src, dst, PAGE_SIZE, token)) == 8 * PAGE_SIZE * 2


def test_the_layout_of_a_pool_carries_its_buffers_as_byte_tensors_on_the_pools_device():
    """Staged and head-sliced pages are gathered and scattered through these (tensor operations on the pool's
    device), not through views of raw addresses, which the CPU cannot make of device memory."""
    from disagg_worker.disagg.base import KVLayout
    from disagg_worker.mem.kv_pool import KVPool

    pool = KVPool(num_layers=2, num_pages=4, page_size=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    layout = KVLayout.from_pool(pool, "float32")
    assert len(layout.buffers) == len(pool.buffers()) == len(layout.buffer_ptrs)
    for view, buf in zip(layout.buffers, pool.buffers(), strict=True):
        assert view.dtype == torch.uint8 and view.device == buf.device and view.data_ptr() == buf.data_ptr()
        view[:4] = torch.tensor([0, 0, 128, 63], dtype=torch.uint8)  # 1.0f, little-endian: written into the pool
        assert buf.reshape(-1)[0].item() == 1.0
