"""Prefill and decode ranks holding different KV heads and layers: the mapping (which prefill rank
feeds which decode head of which layer), its refusals, and the head-slice writes checked byte for
byte by carrying out the planned writes with memmove between real tensors (no Mooncake)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg import KVLayout
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.bootstrap_client import Topology
from disagg_worker.disagg.mapping import NOTHING, HeadSlice, check_compatible
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import Shard, check_parallel

PAGE_SIZE, HEAD_NBYTES = 4, 16


def model(kv_heads: int, layers: int) -> ModelConfig:
    return ModelConfig(
        arch="llama",
        vocab_size=16,
        hidden_size=64,
        intermediate_size=64,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=kv_heads,
        head_dim=4,
    )


def prefill_topology(m: ModelConfig, tp: int, pp: int, page_size: int = PAGE_SIZE, kv_dtype: str = "float32"):
    """The topology a prefill instance of `tp x pp` ranks registers, heads and layers as its shards hold them."""
    ranks = []
    for p in range(pp):
        for t in range(tp):
            shard = Shard(tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
            heads, layers = shard.kv_heads(m), shard.layer_range(m.num_layers)
            ranks.append(
                RankRegistration(
                    tp_rank=t,
                    tp_size=tp,
                    pp_rank=p,
                    pp_size=pp,
                    rank_ip="10.0.0.1",
                    rank_port=6000 + 10 * p + t,
                    page_size=page_size,
                    kv_dtype=kv_dtype,
                    session_id="s",
                    start_layer=layers.start,
                    num_layers=len(layers),
                    kv_head_start=heads.start,
                    num_kv_heads=len(heads),
                    head_nbytes=HEAD_NBYTES,
                )
            )
    return Topology(instance_id="i", tp_size=tp, pp_size=pp, page_size=page_size, kv_dtype=kv_dtype, ranks=ranks)


def decode_layout(m: ModelConfig, shard: Shard, head_nbytes: int = HEAD_NBYTES, kv_dtype: str = "float32"):
    heads, layers = shard.kv_heads(m), shard.layer_range(m.num_layers)
    n = 2 * len(layers)
    page = PAGE_SIZE * len(heads) * head_nbytes
    return KVLayout(
        [4096] * n,
        [page * 8] * n,
        page,
        PAGE_SIZE,
        kv_dtype,
        8,
        start_layer=layers.start,
        kv_head_start=heads.start,
        num_kv_heads=len(heads),
    )


def plan(m: ModelConfig, prefill: tuple[int, int], decode: tuple[int, int], tp_rank: int, pp_rank: int = 0):
    topo = prefill_topology(m, *prefill)
    shard = Shard(tp_rank=tp_rank, tp_size=decode[0], pp_rank=pp_rank, pp_size=decode[1])
    cfg = DisaggConfig(role=Role.DECODE, tp_size=decode[0], pp_size=decode[1])
    return check_compatible(topo, cfg, decode_layout(m, shard), tp_rank, pp_rank)


sizes = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=300, deadline=None)
@given(tp_p=sizes, tp_d=sizes, kv=sizes, pp_p=st.integers(1, 3), decode_pp1=st.booleans(), layers=st.integers(3, 7))
def test_every_decode_head_of_every_layer_comes_from_exactly_one_prefill_rank_that_holds_it(
    tp_p, tp_d, kv, pp_p, decode_pp1, layers
):
    m = model(kv, layers)
    pp_d = 1 if decode_pp1 else pp_p
    assume(check_parallel(m, tp_p, pp_p) == "" and check_parallel(m, tp_d, pp_d) == "")
    asked: Counter[tuple[int, int]] = Counter()
    fan_in: dict[tuple[int, int], int] = {}
    for q in range(pp_d):
        for d in range(tp_d):
            shard = Shard(tp_rank=d, tp_size=tp_d, pp_rank=q, pp_size=pp_d)
            targets, err = plan(m, (tp_p, pp_p), (tp_d, pp_d), d, q)
            assert not err, err
            mine = shard.kv_heads(m)
            for layer in shard.layer_range(layers):
                for head in mine:
                    sources = [
                        t
                        for t in targets
                        if layer in t.layers and t.heads.dst <= head - mine.start < t.heads.dst + t.heads.count
                    ]
                    assert len(sources) == 1, f"decode head {head} of layer {layer} written {len(sources)} times"
                    t = sources[0]
                    src_head = t.rank.kv_head_start + t.heads.src + (head - mine.start - t.heads.dst)
                    assert src_head == head and head in t.rank.kv_heads, "the slice must carry the same head"
            for t in targets:
                whole = t.heads.count == t.rank.num_kv_heads == len(mine)
                assert t.whole == whole and (t.heads.count > 0 or t.heads == NOTHING)
                asked[(t.tp_rank, t.pp_rank)] += 1
                assert fan_in.setdefault((t.tp_rank, t.pp_rank), t.decode_ranks) == t.decode_ranks
    # Every prefill rank is asked for every room (or its room would wait for a request that never
    # comes), by as many decode ranks as each of them announces.
    assert asked == fan_in and set(asked) == {(t, p) for t in range(tp_p) for p in range(pp_p)}


def test_tp_examples_name_slices_and_fan_in():
    two = model(2, 4)
    targets, _ = plan(two, (2, 1), (1, 1), tp_rank=0)  # decode holds both heads: one from each rank
    assert [(t.tp_rank, t.heads, t.whole, t.decode_ranks) for t in targets] == [
        (0, HeadSlice(0, 0, 1), False, 1),
        (1, HeadSlice(0, 1, 1), False, 1),
    ]
    targets, _ = plan(two, (1, 1), (2, 1), tp_rank=1)  # decode rank 1 holds head 1: prefill's second
    assert [(t.tp_rank, t.heads, t.whole, t.decode_ranks) for t in targets] == [(0, HeadSlice(1, 0, 1), False, 2)]
    one = model(1, 4)  # one KV head, replicated on both prefill ranks: written once, by rank 0
    targets, _ = plan(one, (2, 1), (1, 1), tp_rank=0)
    assert [(t.tp_rank, t.heads, t.whole) for t in targets] == [(0, HeadSlice(0, 0, 1), True), (1, NOTHING, False)]
    targets, _ = plan(two, (2, 1), (2, 1), tp_rank=1)  # equal TP: whole pages, one to one
    assert [(t.tp_rank, t.heads, t.whole, t.decode_ranks) for t in targets] == [(1, HeadSlice(0, 0, 1), True, 1)]
    targets, _ = plan(two, (1, 2), (1, 1), tp_rank=0)  # PP 2 -> 1: both stages, their own layers
    assert [(t.pp_rank, t.layers) for t in targets] == [(0, range(0, 2)), (1, range(2, 4))]


@pytest.mark.parametrize(
    "prefill,decode,rank,needles",
    [
        ((1, 2), (1, 3), (0, 2), ["prefill pp_size=2", "decode pp_size=3", "must be equal or 1"]),
        ((2, 1), (3, 1), (0, 0), ["prefill tp_size=2", "decode tp_size=3", "one must divide the other"]),
    ],
)
def test_unsupported_parallel_mappings_are_refused_naming_both_sides(prefill, decode, rank, needles):
    targets, err = plan(model(2, 6), prefill, decode, *rank)
    assert targets == [] and all(n in err for n in needles), err


def test_geometry_mismatches_are_refused_naming_both_sides():
    m = model(2, 4)
    cfg = DisaggConfig(role=Role.DECODE)
    lay = decode_layout(m, Shard(), head_nbytes=8)
    targets, err = check_compatible(prefill_topology(m, 1, 1), cfg, lay, 0, 0)
    assert targets == [] and "prefill head_nbytes=16" in err and "decode head_nbytes=8" in err
    targets, err = check_compatible(
        prefill_topology(m, 1, 1, kv_dtype="bfloat16"), cfg, decode_layout(m, Shard()), 0, 0
    )
    assert "prefill kv_dtype=bfloat16" in err and "decode kv_dtype=float32" in err
    # A decode rank that says it holds heads [0, 1) with TP 2 (its engine forgot the shard's head range).
    shard = Shard(tp_rank=1, tp_size=2)
    wrong = decode_layout(m, Shard(tp_rank=0, tp_size=2))
    cfg2 = DisaggConfig(role=Role.DECODE, tp_size=2)
    targets, err = check_compatible(prefill_topology(m, 2, 1), cfg2, wrong, shard.tp_rank, 0)
    assert targets == [] and "none holds head 0" in err and "tp_rank=1 [1, 2)" in err
    # Decode PP=2 over prefill PP=2, but its stage holds other layers than prefill's.
    short = KVLayout([1] * 2, [4096] * 2, 128, PAGE_SIZE, "float32", 8, start_layer=2, num_kv_heads=2)
    targets, err = check_compatible(prefill_topology(m, 1, 2), DisaggConfig(role=Role.DECODE, pp_size=2), short, 0, 1)
    assert targets == [] and "prefill pp_rank 1 holds layers [2, 4)" in err and "decode holds [2, 3)" in err


ints = st.integers(-(2**31), 2**31)


@given(src=ints, dst=ints, n=ints, ranks=ints, heads=ints, head_nbytes=ints)
def test_codec_round_trips_head_slices_and_refuses_them_malformed(src, dst, n, ranks, heads, head_nbytes):
    from disagg_worker.disagg.messages import CodecError, DecodeHello, RoomRequest, decode, encode

    req = RoomRequest(
        decode_id="d",
        reply_endpoint="e",
        room=7,
        dest_pages=[1, 2],
        aux_slot=0,
        src_head=src,
        dst_head=dst,
        num_heads=n,
        decode_ranks=ranks,
    )
    assert decode(encode(req)) == req
    hello = DecodeHello(
        decode_id="d",
        reply_endpoint="e",
        session_id="s",
        buffer_ptrs=[1],
        buffer_nbytes=[2],
        page_nbytes=3,
        start_layer=0,
        aux_item_nbytes=16,
        num_kv_heads=heads,
        head_nbytes=head_nbytes,
    )
    assert decode(encode(hello)) == hello
    frame = encode(req)
    for bad in (
        frame.replace(b'"decode_ranks":', b'"decode_rank":'),
        frame.replace(f'"num_heads":{n}'.encode(), b'"num_heads":true'),
        frame.replace(f'"src_head":{src}'.encode(), b'"src_head":"0"'),
        frame.replace(f',"dst_head":{dst}'.encode(), b""),
    ):
        with pytest.raises(CodecError):
            decode(bad)


def test_layout_and_registration_carry_the_head_range():
    from dataclasses import asdict

    from disagg_worker.mem.kv_pool import KVPool

    pool = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    lay = KVLayout.from_pool(pool, "float16", kv_heads=range(4, 6))
    assert (lay.kv_heads, lay.head_nbytes, lay.page_nbytes) == (range(4, 6), 16, 4 * 2 * 16)
    assert KVLayout.from_pool(pool, "float16").kv_heads == range(0, 2)
    with pytest.raises(ValueError, match="not the pool's 2 heads"):
        KVLayout.from_pool(pool, "float16", kv_heads=range(0, 1))
    with pytest.raises(ValueError, match="do not split a page"):
        KVLayout([1, 2], [4096] * 2, page_nbytes=100, page_size=4, kv_dtype="x", num_pages=4, num_kv_heads=3)
    reg = asdict(prefill_topology(model(2, 4), 1, 1).ranks[0])
    assert RankRegistration.from_json(reg).kv_heads == range(0, 2)
    for name, value in (("num_kv_heads", 0), ("head_nbytes", 0), ("kv_head_start", -1), ("head_nbytes", True)):
        with pytest.raises(ValueError, match=name):
            RankRegistration.from_json({**reg, name: value})
    with pytest.raises(ValueError, match="missing fields"):
        RankRegistration.from_json({k: v for k, v in reg.items() if k != "kv_head_start"})


def test_bootstrap_server_refuses_a_rank_whose_head_size_differs_from_the_others():
    from dataclasses import replace

    from disagg_worker.disagg.bootstrap import BootstrapServer
    from disagg_worker.disagg.bootstrap_client import BootstrapError, fetch_topology, register_rank

    first, second = prefill_topology(model(2, 4), 2, 1).ranks
    srv = BootstrapServer(0, tp_size=2, host="127.0.0.1").start()
    try:
        register_rank(srv.url, first)
        with pytest.raises(BootstrapError, match="409.*head_nbytes 8 differs from 16"):
            register_rank(srv.url, replace(second, head_nbytes=8))
        register_rank(srv.url, second)
        topo = fetch_topology(srv.url)
        assert topo is not None and [r.kv_heads for r in topo.ranks] == [range(0, 1), range(1, 2)]
    finally:
        srv.stop()


def test_a_prefill_room_takes_one_request_per_decode_rank_that_announced_it():
    from disagg_worker.disagg.messages import RoomRequest
    from disagg_worker.disagg.mooncake.prefill_room import PrefillRoom

    def req(decode_id: str, ranks: int = 2, pages: int = 3) -> RoomRequest:
        return RoomRequest(
            decode_id=decode_id,
            reply_endpoint="e",
            room=9,
            dest_pages=list(range(pages)),
            aux_slot=0,
            decode_ranks=ranks,
        )

    room = PrefillRoom(9)
    peer = object()
    assert room.check_request(req("a")) == "" and not room.ready
    room.dests.append((peer, req("a")))  # type: ignore[arg-type]  # the peer is not looked at here
    assert not room.ready
    assert "asked twice" in room.check_request(req("a"))
    assert "announce 2 and 3" in room.check_request(req("b", ranks=3))
    assert "allocated 3 and 4 pages" in room.check_request(req("b", pages=4))
    assert room.check_request(req("b")) == ""
    room.dests.append((peer, req("b")))  # type: ignore[arg-type]
    assert room.ready
    assert "more requests" in room.check_request(req("c"))
