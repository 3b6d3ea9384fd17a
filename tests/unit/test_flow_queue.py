"""Flow control's queue (`flow/queue.py`) and a request's identity (`flow/identity.py`): bands highest first, flows
round-robin inside a band, FIFO within a flow, bounded, each entry accounted for exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.flow.identity import ABSENT, FAIRNESS_HEADER, OBJECTIVE_HEADER, Identity, body_priority, identify
from disagg_worker.flow.policy import FlowPolicy, parse_priorities
from disagg_worker.flow.queue import FlowQueue
from disagg_worker.flow.stats import OTHER, FlowStats, Outcome
from disagg_worker.request.errors import APIError

FLOWS = st.sampled_from(["a", "b", "c", "d"])
BANDS = st.integers(-2, 2)
# One step of a run: push (band, flow, time passed), pop, expire at the current time, or remove the i-th live entry.
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("push"), BANDS, FLOWS, st.floats(0, 3)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("expire")),
        st.tuples(st.just("remove"), st.integers(0, 50)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(STEPS, st.integers(1, 8))
def test_every_entry_is_dispatched_expired_evicted_removed_or_queued_once_and_the_bound_holds(steps, capacity):
    q: FlowQueue[int] = FlowQueue(capacity, ttl_s=5.0)
    now, pushed, live, left = 0.0, 0, {}, []  # live: item -> entry still queued; left: items out, by any way
    for step in steps:
        if step[0] == "push":
            now += step[3]
            flows = q.by_flow()  # before the push
            result = q.push(pushed, step[1], step[2], now)
            if result.entry is not None:
                live[pushed] = result.entry
            else:  # refused: only when full, nothing queued below it, no flow of its band two beyond its own
                lowest = min(q.by_band())
                assert len(q) == capacity and lowest >= step[1]
                mine = flows.get((step[1], step[2]), 0)
                assert step[1] < lowest or all(n < mine + 2 for (b, _), n in flows.items() if b == lowest)
            if result.evicted is not None:
                e = result.evicted
                assert result.entry is not None and e.priority <= step[1]
                assert e.priority < step[1] or flows[(e.priority, e.flow)] >= flows.get((step[1], step[2]), 0) + 2
                assert flows[(e.priority, e.flow)] == max(n for (b, _), n in flows.items() if b == e.priority)
                assert e.priority == min(b for b, _ in flows)
                left.append(live.pop(e.item))
            pushed += 1
        elif step[0] == "pop":
            entry = q.pop()
            assert (entry is None) == (not live)
            if entry is not None:
                assert entry.priority == max(e.priority for e in live.values())  # never waits for a lower band
                left.append(live.pop(entry.item))
        elif step[0] == "expire":
            for entry in q.expire(now):
                assert entry.deadline <= now
                left.append(live.pop(entry.item))
            assert all(e.deadline > now for e in live.values())
        elif live:
            entry = list(live.values())[step[1] % len(live)]
            assert q.remove(entry) and not q.remove(entry)
            left.append(live.pop(entry.item))
        assert len(q) == len(live) <= capacity
        assert sum(q.by_band().values()) == len(q) == sum(q.by_flow().values())
    assert len({e.item for e in left}) == len(left)  # none twice
    assert not {e.item for e in left} & set(live)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(BANDS, FLOWS), min_size=1, max_size=60))
def test_within_a_flow_entries_leave_first_in_first_out(arrivals):
    q: FlowQueue[int] = FlowQueue(len(arrivals), ttl_s=5.0)
    for i, (band, flow) in enumerate(arrivals):
        q.push(i, band, flow, 0.0)
    order = []
    while (entry := q.pop()) is not None:
        order.append(entry)
    assert [e.priority for e in order] == sorted((e.priority for e in order), reverse=True)
    for flow in "abcd":
        for band in range(-2, 3):
            mine = [e.item for e in order if (e.flow, e.priority) == (flow, band)]
            assert mine == sorted(mine)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 5), st.lists(st.integers(0, 4), min_size=1, max_size=40))
def test_with_k_flows_backlogged_each_is_served_in_any_k_consecutive_pops(k, extra):
    """Each flow keeps a backlog (refilled after every pop); fresh arrivals from flows already queued change
    nothing: no flow goes k pops without a turn."""
    q: FlowQueue[str] = FlowQueue(10_000, ttl_s=1e9)
    flows = [f"f{i}" for i in range(k)]
    for f in flows:
        for _ in range(3):
            q.push(f, 0, f, 0.0)
    served = []
    for n in extra:
        for _ in range(n):  # a burst from one flow
            q.push(flows[n % k], 0, flows[n % k], 0.0)
        entry = q.pop()
        assert entry is not None
        served.append(entry.flow)
        q.push(entry.flow, 0, entry.flow, 0.0)  # still backlogged
    for i in range(len(served) - k + 1):
        assert set(served[i : i + k]) == set(flows)


def test_a_full_queue_sheds_the_lowest_bands_newest_and_refuses_the_lowest():
    q: FlowQueue[str] = FlowQueue(3, ttl_s=10.0)
    for name, band, t in (("batch-old", -1, 0.0), ("batch-new", -1, 1.0), ("chat", 0, 2.0)):
        q.push(name, band, "x", t)
    refused = q.push("batch-late", -1, "x", 3.0)
    assert refused.entry is None and refused.evicted is None
    urgent = q.push("urgent", 5, "y", 4.0)
    assert urgent.entry is not None and urgent.evicted is not None and urgent.evicted.item == "batch-new"
    assert [q.pop().item for _ in range(3)] == ["urgent", "chat", "batch-old"]  # type: ignore[union-attr]


def test_a_full_queue_sheds_the_burst_of_one_flow_for_another_flow_of_its_band():
    q: FlowQueue[str] = FlowQueue(4, ttl_s=10.0)
    for i in range(4):
        q.push(f"a{i}", 0, "a", float(i))  # tenant a's burst fills the queue
    b0 = q.push("b0", 0, "b", 4.0)
    assert b0.entry is not None and b0.evicted is not None and b0.evicted.item == "a3"  # a's newest goes
    b1 = q.push("b1", 0, "b", 5.0)
    assert b1.entry is not None and b1.evicted is not None and b1.evicted.item == "a2"
    b2 = q.push("b2", 0, "b", 6.0)  # a holds 2, b 2: equal shares, nothing traded
    assert b2.entry is None and b2.evicted is None
    late = q.push("a4", 0, "a", 7.0)
    assert late.entry is None
    assert sorted(q.by_flow().items()) == [((0, "a"), 2), ((0, "b"), 2)]
    assert [q.pop().item for _ in range(4)] == ["a0", "b0", "a1", "b1"]  # type: ignore[union-attr]


def test_an_entry_expires_at_its_enqueue_time_plus_the_ttl():
    q: FlowQueue[str] = FlowQueue(4, ttl_s=2.0)
    q.push("a", 0, "", 0.0)
    q.push("b", 0, "", 1.0)
    assert q.expire(1.9) == []
    assert [e.item for e in q.expire(2.0)] == ["a"] and len(q) == 1


def test_identity_from_the_objective_the_body_and_the_key():
    policy = FlowPolicy(objectives={"batch": -1, "chat": 5}, key_max={"k1": 2})
    assert identify(policy, {OBJECTIVE_HEADER: "batch"}, 7, "") == Identity(-1, "")
    assert identify(policy, {FAIRNESS_HEADER: "team-a"}, 3, "") == Identity(3, "team-a")
    assert identify(policy, {FAIRNESS_HEADER: "team-a"}, ABSENT, "k1") == Identity(0, "k1")  # the key names it
    assert identify(policy, {OBJECTIVE_HEADER: "chat"}, ABSENT, "k1") == Identity(2, "k1")  # clamped to its cap
    assert identify(policy, {}, -3, "").sheddable


@pytest.mark.parametrize(
    ("headers", "priority", "param"),
    [
        ({}, 11, "priority"),
        ({}, "high", "priority"),
        ({}, 1.5, "priority"),
        ({}, True, "priority"),
        ({OBJECTIVE_HEADER: "nope"}, ABSENT, OBJECTIVE_HEADER),
    ],
)
def test_a_bad_priority_or_objective_is_a_400_naming_it(headers, priority, param):
    with pytest.raises(APIError) as e:
        identify(FlowPolicy(objectives={"batch": -1}), headers, priority, "")
    assert e.value.status == 400 and e.value.param == param


def test_the_body_priority_is_read_only_from_a_json_object_holding_it():
    assert body_priority(b'{"prompt": "x", "priority": 3}') == 3
    assert body_priority(b'{"prompt": "x"}') is ABSENT
    assert body_priority(b'{"prompt": "priority"}') is ABSENT
    assert body_priority(b'["priority"]') is ABSENT and body_priority(b'{"priority": ') is ABSENT


def test_the_flags_pairs_parse_and_a_malformed_one_is_named():
    assert parse_priorities("batch=-1, chat=5", "--flow-objectives") == {"batch": -1, "chat": 5}
    assert parse_priorities("", "--flow-objectives") == {}
    for bad in ("batch", "batch=high", "=3"):
        with pytest.raises(ValueError, match="--flow-objectives"):
            parse_priorities(bad, "--flow-objectives")
    with pytest.raises(ValueError, match="outside"):
        FlowPolicy(objectives={"x": 99})


def test_flow_labels_are_bounded():
    stats = FlowStats(max_flows=2)
    for flow in ("a", "b", "c", "d", "a"):
        stats.count(Outcome.EXPIRED, 0, flow)
    assert stats.counts == {(Outcome.EXPIRED, 0, "a"): 2, (Outcome.EXPIRED, 0, "b"): 1, (Outcome.EXPIRED, 0, OTHER): 2}
