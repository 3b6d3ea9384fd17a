"""The room state machine, tombstones, page-run grouping and the control-plane codec."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.disagg.messages import (
    CodecError,
    DecodeHello,
    RoomAbort,
    RoomRequest,
    RoomUpdate,
    decode,
    encode,
)
from disagg_worker.disagg.poll import KVPoll, StatusCell
from disagg_worker.disagg.rooms import RoomTable
from disagg_worker.disagg.runs import group_runs

ORDER = [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success]


@given(st.lists(st.sampled_from(list(KVPoll)), max_size=12))
def test_status_only_moves_forward_or_to_failed(moves):
    calls, thens = [], []
    cell = StatusCell(on_change=lambda: calls.append(cell.get()))

    def then() -> None:
        thens.append((cell.get(), len(calls)))

    for new in moves:
        before, n_calls, n_thens = cell.get(), len(calls), len(thens)
        changed = cell.fail("boom") if new is KVPoll.Failed else cell.advance(new, then=then)
        after = cell.get()
        assert len(calls) == n_calls + changed, "on_change runs once per move, never for a refused one"
        assert not changed or calls[-1] is after, "on_change sees the new status"
        if new is not KVPoll.Failed:
            assert len(thens) == n_thens + changed, "`then` runs once per move, never for a refused one"
            assert not changed or thens[-1] == (after, n_calls), "`then` sees the new status, before on_change"
        if before.terminal:
            assert not changed and after is before
        elif new is KVPoll.Failed:
            assert changed and after is KVPoll.Failed and cell.reason == "boom"
        else:
            assert changed == (new > before)
            assert after == max(before, new)


def test_failed_keeps_first_reason_and_success_is_final():
    cell = StatusCell()
    assert cell.advance(KVPoll.Transferring)
    assert not cell.advance(KVPoll.WaitingForInput)
    assert cell.fail("first")
    assert not cell.fail("second") and cell.reason == "first"
    done = StatusCell()
    done.advance(KVPoll.Success)
    assert not done.fail("late") and done.get() is KVPoll.Success
    with pytest.raises(ValueError):
        done.advance(KVPoll.Failed)


def test_room_ids_are_never_reused_and_tombstones_are_bounded():
    table: RoomTable[str] = RoomTable(max_tombstones=2)
    assert table.add(1, "a") and not table.add(1, "b")
    assert table.retire(1, "success") == "a"
    assert not table.add(1, "again"), "a finished room must not be attached to a new request"
    assert table.tombstone(1) == "success" and table.get(1) is None
    assert table.retire(99, "failed") is None  # a late abort still leaves a tombstone
    table.retire(2, "failed")
    assert table.tombstone(1) is None and table.tombstone(99) == "failed"


pages = st.lists(st.integers(0, 60), min_size=0, max_size=40)


@given(st.data())
def test_group_runs_covers_the_pairing_with_maximal_runs(data):
    src = data.draw(pages)
    dst = data.draw(st.lists(st.integers(0, 60), min_size=len(src), max_size=len(src)))
    runs = group_runs(src, dst)
    expanded = [(s + k, d + k) for s, d, n in runs for k in range(n)]
    assert expanded == list(zip(src, dst, strict=True))
    assert all(n >= 1 for _, _, n in runs)
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:], strict=False):
        assert not (s2 == s1 + n1 and d2 == d1 + n1), "adjacent runs that could merge"


segments = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 64)), max_size=30)


@settings(max_examples=60)
@given(segments)
def test_group_runs_on_long_page_lists_covers_the_pairing_with_maximal_runs(segs):
    """Lists of 256 pages and more take the vectorised path; one contiguous run is the common case."""
    segs = [(7, 9000, 256), *segs]
    src = [s + k for s, _, n in segs for k in range(n)]
    dst = [d + k for _, d, n in segs for k in range(n)]
    runs = group_runs(src, dst)
    assert [(s + k, d + k) for s, d, n in runs for k in range(n)] == list(zip(src, dst, strict=True))
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:], strict=False):
        assert not (s2 == s1 + n1 and d2 == d1 + n1), "adjacent runs that could merge"
    assert group_runs(list(range(300)), list(range(50, 350))) == [(0, 50, 300)]


def test_group_runs_examples():
    assert group_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert group_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert group_runs([], []) == []
    with pytest.raises(ValueError):
        group_runs([1], [])


ints = st.integers(0, 2**63 - 1)
text = st.text(max_size=20)
messages = st.one_of(
    st.builds(
        DecodeHello,
        decode_id=text,
        reply_endpoint=text,
        session_id=text,
        buffer_ptrs=st.lists(ints),
        buffer_nbytes=st.lists(ints),
        page_nbytes=ints,
        start_layer=ints,
        aux_item_nbytes=ints,
    ),
    st.builds(RoomRequest, decode_id=text, reply_endpoint=text, room=ints, dest_pages=st.lists(ints), aux_slot=ints),
    st.builds(RoomAbort, decode_id=text, room=ints, reason=text),
    st.builds(
        RoomUpdate,
        room=ints,
        tp_rank=ints,
        pp_rank=ints,
        status=st.sampled_from([int(p) for p in KVPoll]),
        reason=text,
        quiesced=st.booleans(),
        aux=st.binary(),
    ),
)


@given(messages)
def test_codec_round_trips_every_message(msg):
    assert decode(encode(msg)) == msg


@settings(max_examples=300)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.dictionaries(text, st.one_of(ints, text, st.booleans())).map(lambda d: __import__("json").dumps(d).encode()),
    )
)
def test_codec_rejects_garbage_with_codec_error(frame):
    """Random bytes and random JSON objects are never a message: each is refused with CodecError
    (no other exception escapes, nothing is accepted)."""
    with pytest.raises(CodecError):
        decode(frame)


def test_codec_rejects_wrong_types_and_fields():
    good = encode(RoomAbort(decode_id="d", room=7, reason="why"))
    assert decode(good) == RoomAbort(decode_id="d", room=7, reason="why")
    for bad in (
        b'{"type":"RoomAbort","decode_id":"d","room":"7","reason":"x"}',
        b'{"type":"RoomAbort","decode_id":"d","room":true,"reason":"x"}',
        b'{"type":"RoomAbort","decode_id":"d","room":7}',
        b'{"type":"RoomAbort","decode_id":"d","room":7,"reason":"x","extra":1}',
        b'{"type":"Nope"}',
        b'{"type":"RoomRequest","decode_id":"d","reply_endpoint":"e","room":7,"dest_pages":[1,true],"aux_slot":0,"staging_offset":-1}',
        b'{"type":"RoomRequest","decode_id":"d","reply_endpoint":"e","room":7,"dest_pages":[1,2.5],"aux_slot":0,"staging_offset":-1}',
        b'{"type":"RoomRequest","decode_id":"d","reply_endpoint":"e","room":7,"dest_pages":3,"aux_slot":0,"staging_offset":-1}',
        b"[1,2]",
        b"\xff",
    ):
        with pytest.raises(CodecError):
            decode(bad)


def test_kv_layout_describes_a_kv_pool_and_rejects_inconsistent_buffers():
    import torch

    from disagg_worker.disagg import KVLayout, pack_first_token, unpack_first_token
    from disagg_worker.mem.kv_pool import KVPool

    pool = KVPool(num_layers=3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    lay = KVLayout.from_pool(pool, "float16", start_layer=3)
    assert lay.num_layers == 3 and len(lay.buffer_ptrs) == 6 and lay.page_nbytes == 4 * 2 * 8 * 2
    assert lay.buffer_ptrs[0] == pool.k_buffer(0).data_ptr() and lay.buffer_ptrs[3] == pool.v_buffer(0).data_ptr()
    with pytest.raises(ValueError):
        KVLayout([1, 2, 3], [64] * 3, page_nbytes=16, page_size=1, kv_dtype="x", num_pages=4)
    with pytest.raises(ValueError):
        KVLayout([1, 2], [64, 32], page_nbytes=16, page_size=1, kv_dtype="x", num_pages=4)
    assert unpack_first_token(pack_first_token(2**40, None)) == (2**40, None)
    assert unpack_first_token(pack_first_token(-1, -3.5)) == (-1, -3.5)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=256, max_size=600))
def test_group_runs_vectorised_path_matches_the_definition(steps):
    src, dst, s, d = [], [], 1000, 5000
    for ds, dd in steps:  # steps of 1 on both sides continue a run, anything else breaks it
        s, d = s + ds, d + dd
        src.append(s)
        dst.append(d)
    runs = group_runs(src, dst)
    assert [(rs + k, rd + k) for rs, rd, n in runs for k in range(n)] == list(zip(src, dst, strict=True))
    assert all(not (a[0] + a[2] == b[0] and a[1] + a[2] == b[1]) for a, b in zip(runs, runs[1:], strict=False))


def test_staging_area_reuses_freed_ranges_and_pages_round_trip():
    import torch

    from disagg_worker.disagg.mooncake.staging import StagingArea, gather, scatter, worth_staging

    area = StagingArea(64 << 10)
    a, b = area.alloc(10_000), area.alloc(20_000)
    assert a >= 0 and b >= a + 10_000 and area.alloc(64 << 10) == -1
    area.free(a, 10_000)
    area.free(b, 20_000)
    assert area.alloc(64 << 10) == 0  # freed neighbours merge back into one range
    area.free(0, 64 << 10)
    pool = torch.randint(0, 255, (64 * 256,), dtype=torch.uint8)
    out = torch.zeros_like(pool)
    block = area.view(area.alloc(3 * 256), 3 * 256)
    gather(pool, 256, [9, 2, 40], block)
    scatter(block, 256, out, [0, 63, 7])
    for src, dst in ((9, 0), (2, 63), (40, 7)):
        assert torch.equal(out[dst * 256 : (dst + 1) * 256], pool[src * 256 : (src + 1) * 256])
    assert worth_staging(list(range(0, 64, 2))) and not worth_staging(list(range(64)))


def test_a_room_is_done_only_when_its_last_send_settles_after_being_queued():
    """A send that settles before the last one is queued leaves the room not done, whatever happens after: a
    decision read after the count would see the last send queued meanwhile and tell decode Success while its
    pages (and the first token) are still on the wire."""
    from disagg_worker.disagg.mooncake.prefill_room import PrefillRoom

    room = PrefillRoom(7)
    room.queue_send(2, last=False, aux=b"", timeout_s=5)  # a chunk's full pages
    settled_first = room.settle_send(64)  # its writes landed before the prompt's last chunk was sent
    room.queue_send(1, last=True, aux=b"first", timeout_s=5)  # the rest, with the first token
    assert settled_first == (False, False)
    assert room.settle_send(32) == (True, False) and room.nbytes == 96
