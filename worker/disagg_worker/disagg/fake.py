"""The `fake` backend: same handles and states, no data moved, everything completes at once.

A sender is WaitingForInput as soon as it exists and Success on its `last` send; a receiver
is WaitingForInput at once and Success once it is `init()`ed and its sender (if one exists in
this process) has sent its last chunk, so the aux record is there when decode reads it.
Handles of one room created in the same process (any fake managers) are paired through a
process-wide fabric: an abort on one side fails the other, and a receiver reads the aux record
its sender sent (zeros if none did).
"""

from __future__ import annotations

import threading

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg.base import (
    KVLayout,
    KVManager,
    KVReceiver,
    KVSender,
    RankInfo,
    TransferFailure,
    check_pages,
)
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.disagg.poll import KVPoll
from disagg_worker.disagg.rooms import RoomTable


class _Fabric:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handles: dict[int, list] = {}
        self._aux: dict[int, bytes] = {}

    def join(self, room: int, handle) -> None:
        with self._lock:
            self._handles.setdefault(room, []).append(handle)

    def post_aux(self, room: int, aux: bytes) -> None:
        with self._lock:
            self._aux[room] = aux

    def aux(self, room: int) -> bytes | None:
        with self._lock:
            return self._aux.get(room)

    def peers(self, room: int, handle) -> list:
        with self._lock:
            return [h for h in self._handles.get(room, []) if h is not handle]


FABRIC = _Fabric()


class _FakeHandle:
    def __init__(self, mgr: FakeKVManager, room: int):
        self.room = room
        self._mgr = mgr
        self._cell = mgr.new_cell(KVPoll.WaitingForInput)
        FABRIC.join(room, self)

    def poll(self) -> KVPoll:
        return self._cell.get()

    def failure_reason(self) -> str:
        return self._cell.reason

    def _fail(self, reason: str) -> None:
        if self._cell.fail(reason):
            self._mgr.rooms.retire(self.room, "failed")

    def _succeed(self) -> None:
        self._cell.advance(KVPoll.Success)
        self._mgr.rooms.retire(self.room, "success")

    def abort(self, reason: str = "aborted") -> None:
        self._fail(reason)
        for peer in FABRIC.peers(self.room, self):
            peer._fail(f"aborted by peer: {reason}")


class FakeSender(_FakeHandle, KVSender):
    def __init__(self, mgr: FakeKVManager, room: int):
        super().__init__(mgr, room)
        self._nbytes = 0

    def send(self, page_indices: list[int], last: bool, aux: bytes | None = None) -> None:
        if self.poll() is KVPoll.Failed:
            return
        bad = check_pages(page_indices, self._mgr.layout.num_pages)
        if bad:
            self.abort(bad)
            return
        self._cell.advance(KVPoll.Transferring)
        layout = self._mgr.layout
        self._nbytes += len(page_indices) * layout.page_nbytes * len(layout.buffer_ptrs)
        if last:
            self._mgr.metrics.transfer_done(self._nbytes, 0.0)
            FABRIC.post_aux(self.room, aux or b"")
            self._succeed()
            for peer in FABRIC.peers(self.room, self):
                if isinstance(peer, FakeReceiver) and peer.inited:
                    peer._succeed()


class FakeReceiver(_FakeHandle, KVReceiver):
    inited = False

    def init(self, dest_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        if self.poll() is KVPoll.Failed:
            return
        bad = check_pages(dest_pages, self._mgr.layout.num_pages)
        if not 0 <= aux_slot < self._mgr.layout.aux_num_slots:
            bad = bad or f"aux slot {aux_slot} out of range"
        if bad:
            self.abort(bad)
            return
        self.inited = True
        senders = [h for h in FABRIC.peers(self.room, self) if isinstance(h, FakeSender)]
        if not senders or any(h.poll() is KVPoll.Success for h in senders):
            self._succeed()  # alone in this process, or the sender already sent its last chunk
        else:
            self._cell.advance(KVPoll.Transferring)

    def failure(self) -> TransferFailure | None:
        return TransferFailure(reason=self._cell.reason) if self.poll() is KVPoll.Failed else None

    def aux_bytes(self) -> bytes:
        aux = FABRIC.aux(self.room) or b""
        return aux.ljust(self._mgr.layout.aux_item_nbytes, b"\0")


class FakeKVManager(KVManager):
    def __init__(self, cfg: DisaggConfig, layout: KVLayout, rank: RankInfo, metrics: TransferMetrics):
        super().__init__(cfg, layout, rank, metrics)
        self.rooms: RoomTable[_FakeHandle] = RoomTable()

    def _new(self, cls, room: int):
        handle = cls(self, room)
        if not self.rooms.add(room, handle):
            handle._cell.fail(f"room {room} was already used on this instance")
        return handle

    def create_sender(self, room: int) -> KVSender:
        if self.role is not Role.PREFILL:
            return super().create_sender(room)
        return self._new(FakeSender, room)

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        if self.role is not Role.DECODE:
            return super().create_receiver(room, bootstrap_addr)
        return self._new(FakeReceiver, room)

    def close(self) -> None:
        for _, handle in self.rooms.snapshot():
            handle._fail("transfer manager closed")
