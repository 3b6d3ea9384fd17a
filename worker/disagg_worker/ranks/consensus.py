"""How the ranks of a multi-rank P/D instance agree on the transfer state of each room.

Every rank owns its slice of the KV (its heads, its layers) and so its own sender (prefill) or
receiver (decode) per room; a request may move on only when every rank's handle allows it, and a
failure on any rank fails it on every rank. Within a pipeline stage the tensor-parallel ranks take
the minimum of their poll states (Failed=0 wins). Across stages the rule of SGLang's
pipeline-parallel prefill loop applies, carried along the pipeline with each step:

- stage 0 (the rank that schedules) proposes the rooms its own state says are ready (handshaken:
  WaitingForInput or later), transferred (Success) or failed;
- a later stage acts only on the consensus: what the stage before passed, intersected with its
  own state. Ready rooms that it also sees ready leave its bootstrap queue and pass on; transferred
  rooms that it also sees transferred pass on; failed rooms are dropped from its queues and pass
  on (a failure anywhere fails everywhere);
- the last stage's result goes back to stage 0, which admits the ready rooms, releases the
  transferred ones and fails the failed ones, and announces the released and failed rooms down the
  pipeline with its next proposal, once, so every stage drops them too. An announcement is not a
  new failure: it travels apart from `failed` (in `dropped`), or it would come back with the result
  and be announced again every round, and the ranks would never stop exchanging rounds.

The orphan fix (SGLang PR for issue #26912): a room whose own poll on a later stage is Failed is
dropped there and reported failed even when it is in none of the sets passed to it; otherwise a
room that stage 0 no longer proposes (it is still bootstrapping there, or already gone) would stay
in that stage's bootstrap queue forever and its queue gauge would never return to 0.

Decode applies the same rule to its prealloc (bootstrap) and transfer (inflight) queues.

Pure: the state of one rank's queues goes in, the sets to pass on and the rooms to drop come out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from disagg_worker.disagg.poll import KVPoll


class Queue(str, Enum):
    BOOTSTRAP = "bootstrap"  # handle created, not yet agreed ready by every stage
    INFLIGHT = "inflight"  # agreed ready; the transfer is still going on


@dataclass(frozen=True)
class Round:
    """What one stage passes to the next (and the last stage back to stage 0), by room.

    `released` and `dropped` come from stage 0 only: rooms every stage agreed were transferred, and
    rooms that failed, in an earlier round (announcements: every stage drops them).
    `failed` holds failures new in this round. `reasons` says why they failed, where a rank knew
    (its own handle's reason)."""

    ready: frozenset[int] = frozenset()
    transferred: frozenset[int] = frozenset()
    failed: frozenset[int] = frozenset()
    released: frozenset[int] = frozenset()
    dropped: frozenset[int] = frozenset()
    reasons: tuple[tuple[int, str], ...] = ()


@dataclass
class StageQueues:
    """One rank's rooms and the queue each is in; on stage 0 also what to announce next round."""

    rooms: dict[int, Queue] = field(default_factory=dict)
    released: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)

    def size(self, queue: Queue) -> int:
        return sum(1 for q in self.rooms.values() if q is queue)


def propose(queues: StageQueues, polls: Mapping[int, KVPoll]) -> tuple[Round, set[int]]:
    """Stage 0: the round to start from its own states, and the rooms it drops (failed here)."""
    ready, transferred, failed = set(), set(), set()
    released, announced = frozenset(queues.released), frozenset(queues.failed)
    queues.failed.clear()
    queues.released.clear()
    for room, queue in queues.rooms.items():
        state = polls[room]
        if state is KVPoll.Failed:
            failed.add(room)
        elif queue is Queue.BOOTSTRAP and state >= KVPoll.WaitingForInput:
            ready.add(room)
        elif queue is Queue.INFLIGHT and state is KVPoll.Success:
            transferred.add(room)
    for room in failed:
        del queues.rooms[room]
    return Round(frozenset(ready), frozenset(transferred), frozenset(failed), released, announced), failed


def follow(queues: StageQueues, polls: Mapping[int, KVPoll], prev: Round, drain_local_failures: bool = True) -> Round:
    """A later stage: act on what the stage before passed, intersected with this stage's states.

    Rooms move from bootstrap to inflight when every stage so far agreed they are ready, and leave
    when they failed anywhere or stage 0 released them. `drain_local_failures=False` is the rule
    without the orphan fix.
    """
    failed = set(prev.failed)
    for room in prev.failed | prev.released | prev.dropped:
        queues.rooms.pop(room, None)
    ready, transferred = set(), set()
    for room, queue in list(queues.rooms.items()):
        state = polls[room]
        mentioned = room in prev.ready or room in prev.transferred
        if state is KVPoll.Failed:
            if mentioned or drain_local_failures:
                failed.add(room)
                del queues.rooms[room]
        elif room in prev.ready and state >= KVPoll.WaitingForInput:
            ready.add(room)
            if queue is Queue.BOOTSTRAP:
                queues.rooms[room] = Queue.INFLIGHT
        elif room in prev.transferred and state is KVPoll.Success:
            transferred.add(room)
    return Round(frozenset(ready), frozenset(transferred), frozenset(failed), prev.released, prev.dropped, prev.reasons)


def settle(queues: StageQueues, result: Round) -> None:
    """Stage 0, when the last stage's result comes back: admitted rooms move to inflight,
    transferred rooms are released and failed rooms leave; both are announced next round."""
    for room in result.failed | result.transferred:
        queues.rooms.pop(room, None)
    queues.released |= result.transferred
    queues.failed |= result.failed
    for room in result.ready:
        if queues.rooms.get(room) is Queue.BOOTSTRAP:
            queues.rooms[room] = Queue.INFLIGHT
