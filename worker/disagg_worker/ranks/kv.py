"""KV transfer handles of a multi-rank P/D instance: one decision, every rank's own transfer.

Every rank owns its slice of the KV and so its own transfer manager and handles. The rank that
schedules (the driver) decides what happens to a room; each decision is a `Command` that the
driver applies to its own handle and sends, with the next step, to every other rank, which applies
it to theirs (`RankTransfer.apply`). What the driver's role stage sees is `RankedKV`: senders and
receivers whose state is the ranks' agreement (ranks/consensus.py), not the driver's alone, so a
request moves on only when every rank can, and fails when any rank failed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from disagg_worker.disagg import KVManager, KVPoll, KVReceiver, KVSender, TransferFailure
from disagg_worker.ranks.consensus import Queue, Round, StageQueues, follow, propose, settle


@dataclass(frozen=True)
class CreateSender:
    room: int


@dataclass(frozen=True)
class CreateReceiver:
    room: int
    bootstrap_addr: str


@dataclass(frozen=True)
class Send:
    room: int
    pages: list[int]
    last: bool
    aux: bytes


@dataclass(frozen=True)
class Stream:
    """Layer-wise streaming: the next forward completes these pages (`KVSender.stream`); every rank arms its own
    layer stream before its forward, which is what the step that carries this command runs."""

    room: int
    pages: list[int]


@dataclass(frozen=True)
class Init:
    room: int
    pages: list[int]
    aux_slot: int
    skip_pages: int = 0


@dataclass(frozen=True)
class Abort:
    room: int
    reason: str


Command = CreateSender | CreateReceiver | Send | Stream | Init | Abort
FAILED_ELSEWHERE = "failed on another rank of this instance"


class RankTransfer:
    """One rank's handles, the queue each room is in, and what the rank passes on each round."""

    def __init__(self, kv: KVManager, fail_new_senders: bool = False):
        """`fail_new_senders` (fault injection for tests): every sender created here fails at
        once, locally, telling nobody."""
        self.kv = kv
        self.fail_new_senders = fail_new_senders
        self.handles: dict[int, KVSender | KVReceiver] = {}
        self.queues = StageQueues()
        # Failed rooms whose destination pages a transfer may still write (decode): reported
        # unsafe each round until the handle says they are safe.
        self.unsafe: dict[int, KVReceiver] = {}

    def apply(self, cmd: Command) -> None:
        if isinstance(cmd, CreateSender):
            self._add(cmd.room, self.kv.create_sender(cmd.room))
            if self.fail_new_senders:
                self.handles[cmd.room].abort("injected local failure")
        elif isinstance(cmd, CreateReceiver):
            self._add(cmd.room, self.kv.create_receiver(cmd.room, cmd.bootstrap_addr))
        elif (h := self.handles.get(cmd.room)) is None:
            return  # the room already ended on this rank
        elif isinstance(cmd, Send) and isinstance(h, KVSender):
            h.send(cmd.pages, cmd.last, cmd.aux or None)
        elif isinstance(cmd, Stream) and isinstance(h, KVSender):
            h.stream(cmd.pages)
        elif isinstance(cmd, Init) and isinstance(h, KVReceiver):
            h.init(cmd.pages, cmd.aux_slot, cmd.skip_pages)
        elif isinstance(cmd, Abort):
            h.abort(cmd.reason)

    def _add(self, room: int, handle: KVSender | KVReceiver) -> None:
        self.handles[room] = handle
        self.queues.rooms[room] = Queue.BOOTSTRAP

    def rooms(self) -> list[int]:
        """The rooms this rank polls this round, in an order every rank of the stage shares."""
        return sorted(self.queues.rooms)

    def local_polls(self, rooms: list[int]) -> list[int]:
        return [int(self.handles[r].poll()) for r in rooms]

    def unsafe_rooms(self) -> set[int]:
        for room, h in list(self.unsafe.items()):
            failure = h.failure()
            if failure is None or not failure.pages_unsafe:
                del self.unsafe[room]
        return set(self.unsafe)

    def round(self, polls: dict[int, KVPoll], prev: Round | None, drain_local_failures: bool = True) -> Round:
        """This rank's part of a round: stage 0 proposes (`prev` None), a later stage follows.
        Rooms that failed here carry their handle's reason."""
        if prev is None:
            rnd, _ = propose(self.queues, polls)
        else:
            rnd = follow(self.queues, polls, prev, drain_local_failures)
        known = dict(rnd.reasons)
        for room in rnd.failed:
            h = self.handles.get(room)
            if room not in known and h is not None and h.poll() is KVPoll.Failed:
                known[room] = _reason(h)
        self._forget(rnd.failed | rnd.released | rnd.dropped)
        return replace(rnd, reasons=tuple(sorted(known.items())))

    def settle(self, result: Round) -> None:
        """Stage 0: the last stage's result came back."""
        settle(self.queues, result)
        self._forget(result.failed | result.transferred)

    def _forget(self, rooms: frozenset[int] | set[int]) -> None:
        for room in rooms:
            h = self.handles.pop(room, None)
            if h is None:
                continue
            if h.poll() is not KVPoll.Success:
                h.abort(FAILED_ELSEWHERE)
            if isinstance(h, KVReceiver) and (f := h.failure()) is not None and f.pages_unsafe:
                self.unsafe[room] = h

    def queue_sizes(self) -> dict[str, int]:
        return {q.value: self.queues.size(q) for q in Queue}


def _reason(h: KVSender | KVReceiver) -> str:
    return h.failure_reason()


@dataclass
class _Agreed:
    state: KVPoll = KVPoll.Bootstrapping
    reason: str = ""
    unsafe: bool = False
    aux: bytes = b""
    # The stage saw the terminal state: the entry goes at the next round unless its pages are unsafe.
    observed: bool = False


def _nothing() -> None:
    pass


class RankedKV:
    """The driver's view: handles whose state is what every rank agreed.

    `commands` collects what the other ranks must apply with the next step; `settle` takes the
    round's result (and the rooms any rank still reports unsafe)."""

    def __init__(self, local: RankTransfer):
        self.local = local
        self.commands: list[Command] = []
        self.agreed: dict[int, _Agreed] = {}
        self.on_change: Callable[[], None] = _nothing  # set by the scheduler loop: wakes it up

    def issue(self, cmd: Command) -> None:
        self.local.apply(cmd)
        self.commands.append(cmd)

    def close(self) -> None:
        self.local.kv.close()

    def take_commands(self) -> list[Command]:
        cmds, self.commands = self.commands, []
        return cmds

    def create_sender(self, room: int) -> KVSender:
        self.issue(CreateSender(room))
        self.agreed[room] = _Agreed()
        return RankedSender(self, room)

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        self.issue(CreateReceiver(room, bootstrap_addr))
        self.agreed[room] = _Agreed()
        return RankedReceiver(self, room)

    def settle(self, result: Round, unsafe: set[int]) -> None:
        for room in result.transferred:
            h = self.local.handles.get(room)
            if (a := self.agreed.get(room)) is not None and a.state is not KVPoll.Failed:
                a.state = KVPoll.Success
                a.aux = h.aux_bytes() if isinstance(h, KVReceiver) else b""
        self.local.settle(result)
        for room in result.ready:
            a = self.agreed.get(room)
            if a is not None and a.state < KVPoll.WaitingForInput:
                a.state = KVPoll.WaitingForInput
        reasons = dict(result.reasons)
        for room in result.failed:
            self.fail(room, reasons.get(room, FAILED_ELSEWHERE), unsafe=room in unsafe)
        for room, a in list(self.agreed.items()):
            if a.observed and not a.unsafe:
                del self.agreed[room]
            else:
                a.unsafe = a.state is KVPoll.Failed and room in unsafe
        if result.ready or result.transferred or result.failed:
            self.on_change()

    def fail(self, room: int, reason: str, unsafe: bool = False) -> None:
        a = self.agreed.get(room)
        if a is not None and a.state is not KVPoll.Failed and a.state is not KVPoll.Success:
            a.state, a.reason, a.unsafe = KVPoll.Failed, reason, unsafe

    def state(self, room: int) -> _Agreed:
        """The agreed state of `room`, marked observed once terminal (a gone room reads Failed)."""
        a = self.agreed.get(room) or _Agreed(KVPoll.Failed, "the room ended on this instance")
        a.observed = a.observed or a.state.terminal
        return a


class RankedSender(KVSender):
    def __init__(self, kv: RankedKV, room: int):
        self.room = room
        self._kv = kv

    def poll(self) -> KVPoll:
        return self._kv.state(self.room).state

    def send(self, page_indices: list[int], last: bool, aux: bytes | None = None) -> None:
        self._kv.issue(Send(self.room, list(page_indices), last, aux or b""))

    def stream(self, page_indices: list[int]) -> None:
        self._kv.issue(Stream(self.room, list(page_indices)))

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._kv.issue(Abort(self.room, reason))
        self._kv.fail(self.room, reason)

    def failure_reason(self) -> str:
        return self._kv.state(self.room).reason


class RankedReceiver(KVReceiver):
    def __init__(self, kv: RankedKV, room: int):
        self.room = room
        self._kv = kv

    def poll(self) -> KVPoll:
        return self._kv.state(self.room).state

    def init(self, dest_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        self._kv.issue(Init(self.room, list(dest_pages), aux_slot, skip_pages))

    def abort(self, reason: str = "aborted by decode") -> None:
        self._kv.issue(Abort(self.room, reason))
        self._kv.fail(self.room, reason, unsafe=True)

    def failure(self) -> TransferFailure | None:
        a = self._kv.state(self.room)
        return TransferFailure(a.reason, a.unsafe) if a.state is KVPoll.Failed else None

    def aux_bytes(self) -> bytes:
        return self._kv.state(self.room).aux
