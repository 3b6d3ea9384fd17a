"""The pipeline stages' agreement on each room's transfer state (ranks/consensus.py).

A room moves on only when every stage agrees, fails everywhere when it fails anywhere (stage 0 at
once, the others when stage 0 announces it, once), and never stays in a stage's queue once it can
no longer move: the orphan fix of SGLang's PP prefill loop.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.disagg.poll import KVPoll
from disagg_worker.ranks.consensus import Queue, Round, StageQueues, follow, propose, settle

B, W, S, F = KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Success, KVPoll.Failed


def run_round(stages: list[StageQueues], polls: list[dict[int, KVPoll]], fix: bool = True) -> Round:
    """One round through every stage and back to stage 0."""
    rnd, _ = propose(stages[0], polls[0])
    for queues, p in zip(stages[1:], polls[1:], strict=True):
        rnd = follow(queues, p, rnd, drain_local_failures=fix)
    settle(stages[0], rnd)
    return rnd


def bootstrap(rooms: list[int], n: int = 2) -> list[StageQueues]:
    return [StageQueues({r: Queue.BOOTSTRAP for r in rooms}) for _ in range(n)]


def test_a_room_is_admitted_only_when_every_stage_is_ready():
    stages = bootstrap([7])
    assert run_round(stages, [{7: W}, {7: B}]).ready == frozenset()
    assert stages[0].rooms == {7: Queue.BOOTSTRAP} and stages[1].rooms == {7: Queue.BOOTSTRAP}
    assert run_round(stages, [{7: W}, {7: W}]).ready == {7}
    assert stages[0].rooms == {7: Queue.INFLIGHT} and stages[1].rooms == {7: Queue.INFLIGHT}


def test_a_transfer_is_released_only_when_every_stage_finished():
    stages = [StageQueues({3: Queue.INFLIGHT}) for _ in range(3)]
    assert run_round(stages, [{3: S}, {3: S}, {3: W}]).transferred == frozenset()
    assert all(s.rooms == {3: Queue.INFLIGHT} for s in stages)
    assert run_round(stages, [{3: S}, {3: S}, {3: S}]).transferred == {3}
    assert stages[0].rooms == {}  # stage 0 releases at once ...
    run_round(stages, [{}, {3: S}, {3: S}])
    assert all(s.rooms == {} for s in stages)  # ... and the others when it announces the release


def test_a_failure_on_stage_zero_drops_the_room_everywhere():
    stages = bootstrap([1, 2])
    rnd = run_round(stages, [{1: F, 2: W}, {1: B, 2: W}])
    assert rnd.failed == {1} and rnd.ready == {2}
    assert 1 not in stages[0].rooms and 1 not in stages[1].rooms


def test_a_failure_on_the_last_stage_reaches_the_stages_before_it():
    stages = bootstrap([4], n=3)
    assert run_round(stages, [{4: B}, {4: B}, {4: F}]).failed == {4}
    assert 4 not in stages[0].rooms and 4 in stages[1].rooms
    run_round(stages, [{}, {4: B}, {}])  # stage 0 announces the failure
    assert all(s.rooms == {} for s in stages)


def test_orphan_fix_a_local_failure_on_a_later_stage_is_drained_though_nobody_proposed_it():
    """Stage 0 still waits for decode's handshake (it proposes nothing); stage 1's own handle
    failed. With the fix the room leaves stage 1 at once and its failure reaches stage 0."""
    stages = bootstrap([9])
    rnd = run_round(stages, [{9: B}, {9: F}])
    assert rnd.failed == {9}
    assert stages[0].rooms == {} and stages[1].rooms == {}  # stage 0 fails the request at once


def test_without_the_fix_the_same_room_stays_in_the_later_stage_queue():
    stages = bootstrap([9])
    for _ in range(5):  # stage 0 keeps waiting: nothing it passes on mentions the room
        rnd = run_round(stages, [{9: B}, {9: F}], fix=False)
        assert rnd.failed == frozenset()
    assert stages[1].size(Queue.BOOTSTRAP) == 1  # the orphan: the gauge never returns to 0


polls = st.sampled_from([B, W, S, F])


def states_for(stages: list[StageQueues], step: list[KVPoll], ended: dict[int, KVPoll]) -> list[dict[int, KVPoll]]:
    """Each stage's poll of the rooms it holds: the trace's value, or the terminal state of a room
    that ended (a stage learns of it one round later)."""
    return [{r: ended.get(r, step[(r + k) % 3]) for r in s.rooms} for k, s in enumerate(stages)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(polls, min_size=3, max_size=3), min_size=1, max_size=12), st.integers(2, 3))
def test_rounds_keep_stages_consistent(trace, n_stages):
    """Whatever each stage sees, in any round: a room is admitted or released only with every
    stage's agreement, a failure anywhere ends the room everywhere (stage 0 at once, every other
    stage by the next round), and once every handle is terminal a few more rounds leave every
    queue empty."""
    rooms = [0, 1, 2]
    stages = bootstrap(rooms, n_stages)
    ended: dict[int, KVPoll] = {}
    for step in trace:
        states = states_for(stages, step, ended)
        before = [dict(s.rooms) for s in stages]
        rnd = run_round(stages, states)
        held = [{r for r in st if r not in ended} for st in states]
        for r in rnd.ready:
            assert all(r in h and states[k][r] >= W for k, h in enumerate(held))
        for r in rnd.transferred:
            assert all(r in h and states[k][r] is S for k, h in enumerate(held))
            ended[r] = S
        assert not rnd.failed & ended.keys(), "a failure is reported once, then only announced"
        for r in rnd.failed:
            assert any(states[k].get(r) is F for k in range(n_stages))
            ended[r] = F
        assert all(r not in stages[0].rooms for r in ended)
        assert all(set(s.rooms) <= set(b) for s, b in zip(stages, before, strict=True))
    for _ in range(3):
        run_round(stages, [{r: ended.get(r, F) for r in s.rooms} for s in stages])
    assert all(s.rooms == {} for s in stages)
    # ... and nothing is left to announce: the ranks stop exchanging rounds (before, every failed
    # room came back with each result and was announced again, forever)
    assert stages[0].failed == set() and stages[0].released == set()
