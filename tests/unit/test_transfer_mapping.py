"""Compatibility rules between a prefill instance and a decode rank, the PP layer mapping,
and heartbeat loss detection (with a scripted health check, no network)."""

from __future__ import annotations

import threading
import time

import pytest

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg import KVLayout
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.bootstrap_client import Topology
from disagg_worker.disagg.heartbeat import HeartbeatMonitor
from disagg_worker.disagg.mapping import check_compatible, layer_buffer_map
from tests.timing import scaled

LAYOUT = KVLayout([1, 2, 3, 4], [1024] * 4, page_nbytes=256, page_size=16, kv_dtype="bfloat16", num_pages=4)


def layout(layers: int = 2, start_layer: int = 0) -> KVLayout:
    """LAYOUT (one KV head of 16 bytes) holding `layers` layers from `start_layer`."""
    n = 2 * layers
    return KVLayout([1] * n, [1024] * n, 256, 16, "bfloat16", 4, start_layer=start_layer)


def topo(tp=1, pp=1, page_size=16, kv_dtype="bfloat16"):
    ranks = [
        RankRegistration(
            tp_rank=t,
            tp_size=tp,
            pp_rank=p,
            pp_size=pp,
            rank_ip="10.0.0.9",
            rank_port=5000 + 10 * p + t,
            page_size=page_size,
            kv_dtype=kv_dtype,
            session_id="s",
            start_layer=2 * p,
            num_layers=2,
            kv_head_start=0,
            num_kv_heads=1,
            head_nbytes=16,
        )
        for p in range(pp)
        for t in range(tp)
    ]
    return Topology(instance_id="id", tp_size=tp, pp_size=pp, page_size=page_size, kv_dtype=kv_dtype, ranks=ranks)


def cfg(tp=1, pp=1):
    return DisaggConfig(role=Role.DECODE, tp_size=tp, pp_size=pp)


def test_equal_tp_maps_rank_to_rank_and_pp1_decode_pulls_every_stage():
    targets, err = check_compatible(topo(tp=2), cfg(tp=2), LAYOUT, tp_rank=1, pp_rank=0)
    assert not err and [(r.tp_rank, r.pp_rank) for r in targets] == [(1, 0)]
    targets, err = check_compatible(topo(tp=2, pp=3), cfg(tp=2, pp=1), layout(6), tp_rank=0, pp_rank=0)
    assert not err and [(r.tp_rank, r.pp_rank) for r in targets] == [(0, 0), (0, 1), (0, 2)]
    targets, err = check_compatible(topo(pp=2), cfg(pp=2), layout(2, start_layer=2), tp_rank=0, pp_rank=1)
    assert [(r.tp_rank, r.pp_rank) for r in targets] == [(0, 1)]


@pytest.mark.parametrize(
    "t,c,needles",
    [
        (topo(page_size=32), cfg(), ["prefill page_size=32", "decode page_size=16"]),
        (topo(kv_dtype="float32"), cfg(), ["prefill kv_dtype=float32", "decode kv_dtype=bfloat16"]),
        (topo(tp=2), cfg(tp=3), ["prefill tp_size=2", "decode tp_size=3"]),
        (topo(pp=2), cfg(pp=3), ["prefill pp_size=2", "decode pp_size=3"]),
    ],
)
def test_mismatch_names_both_values(t, c, needles):
    targets, err = check_compatible(t, c, LAYOUT, 0, 0)
    assert targets == [] and all(n in err for n in needles), err


def test_layer_map_places_a_pp_stage_inside_the_full_decode_pool():
    # prefill stage holding layers [2, 4) -> decode holding all 4 layers: K2,K3,V2,V3
    assert layer_buffer_map(2, 2, 0, 4) == [2, 3, 6, 7]
    assert layer_buffer_map(0, 3, 0, 3) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match=r"layers \[2, 4\)"):
        layer_buffer_map(2, 2, 0, 3)


def test_heartbeat_reports_loss_after_max_misses_and_restart_at_once():
    answers = {"a:1": ["id", None, "id", None, None, None], "b:1": ["id", "other"]}
    lost: list[tuple[str, str, bool]] = []
    done = threading.Event()

    def check(addr, timeout):
        seq = answers[addr]
        return seq.pop(0) if seq else None

    def on_lost(addr, reason, restarted):
        lost.append((addr, reason, restarted))
        if len(lost) == 2:
            done.set()

    mon = HeartbeatMonitor(0.01, 2, on_lost, check=check)  # no on_dead: no probation
    mon.watch("a:1", "id")
    mon.watch("b:1", "id")
    assert done.wait(scaled(5))
    mon.close()
    by_addr = {a: (r, dead) for a, r, dead in lost}
    assert by_addr["b:1"] == ("prefill instance b:1 restarted (instance id changed)", True)
    assert "2 heartbeats missed" in by_addr["a:1"][0] and by_addr["a:1"][1] is False
    assert answers["a:1"] == [None], "one miss followed by a success must reset the count"
    time.sleep(0.05)
    assert len(lost) == 2, "a lost instance is reported once"


def test_heartbeat_refused_port_is_a_dead_instance_but_silence_is_not():
    from disagg_worker.disagg.bootstrap_client import REFUSED

    answers = {"gone:1": [REFUSED, REFUSED], "silent:1": [None, None]}
    lost: dict[str, tuple[str, bool]] = {}
    done = threading.Event()

    def on_lost(addr, reason, dead):
        lost[addr] = (reason, dead)
        if len(lost) == 2:
            done.set()

    mon = HeartbeatMonitor(0.01, 2, on_lost, check=lambda a, t: answers[a].pop(0) if answers[a] else None)
    mon.watch("gone:1", "id")
    mon.watch("silent:1", "id")
    assert done.wait(scaled(5))
    mon.close()
    assert lost["gone:1"] == ("prefill instance gone:1 is gone (connection refused)", True)
    assert lost["silent:1"] == ("prefill instance silent:1 lost: 2 heartbeats missed", False)


def test_silent_instance_is_declared_dead_once_its_port_refuses():
    from disagg_worker.disagg.bootstrap_client import REFUSED

    # lost by silence, then two more silent probes, then the port refuses: dead
    answers = {"a:1": [None, None, None, None, REFUSED], "b:1": [None, None, "id"]}
    events: list[tuple[str, str]] = []
    dead_seen = threading.Event()

    def on_dead(addr):
        events.append(("dead", addr))
        dead_seen.set()

    mon = HeartbeatMonitor(
        0.01,
        2,
        lambda a, r, d: events.append(("lost", a)),
        on_dead,
        check=lambda a, t: answers[a].pop(0) if answers[a] else "id",
    )
    mon.watch("a:1", "id")
    mon.watch("b:1", "id")
    assert dead_seen.wait(scaled(5))
    time.sleep(0.1)
    mon.close()
    assert events.count(("lost", "a:1")) == 1 and events.count(("lost", "b:1")) == 1
    assert ("dead", "a:1") in events
    assert ("dead", "b:1") not in events, "an instance that answers again as itself is not dead"
