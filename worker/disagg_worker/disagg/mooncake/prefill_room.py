"""State of one room on a prefill rank, shared by its control side (`prefill`), its sends
(`prefill_sends`) and its writes (`prefill_writes`).

A room is written to one decode rank, or to several when decode has more TP ranks than prefill
(each takes its slice of this rank's KV heads); each send becomes one `SendJob` per decode rank.
The room counts the jobs not yet settled, so that a failed room knows whether decode may reuse
its pages at once or must wait for a second Failed update (`quiesced=True`) once the last write
in flight has settled.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from disagg_worker.disagg.layerwise import StreamRound
from disagg_worker.disagg.messages import RoomRequest
from disagg_worker.disagg.mooncake.engine import WriteGroup
from disagg_worker.disagg.mooncake.peers import DecodePeer
from disagg_worker.disagg.poll import KVPoll, StatusCell
from disagg_worker.tuning import TUNING


@dataclass
class PrefillRoom:
    room: int
    cell: StatusCell = field(default_factory=StatusCell)
    created: float = field(default_factory=time.monotonic)
    # Every decode request received for this room: each is told how the room ends.
    requests: list[RoomRequest] = field(default_factory=list)
    # The accepted ones with their peers; WaitingForInput once all `decode_ranks` of them arrived.
    dests: list[tuple[DecodePeer, RoomRequest]] = field(default_factory=list)
    sent: int = 0  # the room's pages consumed by send() so far (those decode holds, `skip_pages`, included)
    streamed: int = 0  # the room's pages whose model layers a layer-wise stream queued (`disagg.layerwise`)
    inflight: int = 0  # jobs (a send to one decode rank) queued or on the wire and not yet settled
    last_queued: bool = False
    nbytes: int = 0
    first_send: float = 0.0
    aux: bytes = b""
    owes_quiesced: bool = False  # decode was told Failed while writes were still in flight
    deadline: float = 0.0  # all queued writes must have landed by then (waiting timeout)
    lock: threading.Lock = field(default_factory=threading.Lock)  # inflight, last_queued, owes_quiesced

    @property
    def ready(self) -> bool:
        """Every decode rank that writes this room sent its request."""
        return bool(self.dests) and len(self.dests) == self.dests[0][1].decode_ranks

    def check_request(self, req: RoomRequest) -> str:
        """ "" if `req` joins the requests accepted so far: one per decode rank, as many as they
        all announce, with as many destination pages each."""
        if not self.dests:
            return ""
        first = self.dests[0][1]
        if any(r.decode_id == req.decode_id for _, r in self.dests):
            return f"decode {req.decode_id} asked twice for room {req.room}"
        if req.decode_ranks != first.decode_ranks:
            return f"decode ranks announce {first.decode_ranks} and {req.decode_ranks} requests for room {req.room}"
        if len(self.dests) >= first.decode_ranks:
            return f"more requests for room {req.room} than the {first.decode_ranks} decode ranks announced"
        if len(req.dest_pages) != len(first.dest_pages) or req.skip_pages != first.skip_pages:
            return (
                f"decode ranks allocated {len(first.dest_pages)} and {len(req.dest_pages)} pages after "
                f"{first.skip_pages} and {req.skip_pages} held pages for one room"
            )
        return ""

    @property
    def skip(self) -> int:
        """The room's first pages, which decode holds already (never sent)."""
        return self.dests[0][1].skip_pages if self.dests else 0

    def check_stream(self, n_pages: int) -> tuple[int, str]:
        """Where a layer-wise stream of `n_pages` starts (where the previous stream, or the sends if further,
        stopped), and "" or why it may not."""
        start, status = max(self.streamed, self.sent), self.cell.get()
        if status < KVPoll.WaitingForInput or not self.ready or self.last_queued:
            return start, f"stream() in status {status.name}" + (" after the last chunk" if self.last_queued else "")
        allocated = self.skip + len(self.dests[0][1].dest_pages)
        if start + n_pages > allocated:
            return start, f"{start + n_pages} pages streamed but decode allocated {allocated}"
        return start, ""

    def skip_send(self, n_pages: int) -> None:
        """A send of pages decode holds already: counted, nothing written."""
        with self.lock:
            self.sent += n_pages

    def queue_send(self, n_pages: int, last: bool, aux: bytes, timeout_s: float, jobs: int = 1) -> int:
        """Count one more send of `n_pages` (`jobs` jobs: one per decode rank); returns the
        destination index of its first page."""
        first_index = self.sent
        with self.lock:
            self.sent += n_pages
            self.inflight += jobs
            self.last_queued = last
            self.aux = aux if last else self.aux
            self.first_send = self.first_send or time.monotonic()
            self.deadline = time.monotonic() + timeout_s
        return first_index

    def queue_stream(self, jobs: int, timeout_s: float) -> bool:
        """Count the `jobs` jobs of one streamed layer group; False (nothing counted) once the room failed.
        Checked and counted under the lock that `quiet_on_failure` reads, so a room that fails meanwhile
        either refuses the group or owes decode the quiesced update once the group settles."""
        with self.lock:
            if self.cell.get() is KVPoll.Failed:
                return False
            self.inflight += jobs
            self.first_send = self.first_send or time.monotonic()
            self.deadline = time.monotonic() + timeout_s
        return True

    def quiet_on_failure(self) -> bool:
        """The room just failed. True if no send is in flight (decode may reuse its pages now);
        else decode is owed a quiesced update when the last one settles."""
        with self.lock:
            quiet = self.inflight == 0
            self.owes_quiesced = not quiet
        return quiet

    def settle_send(self, nbytes: int) -> tuple[bool, bool]:
        """One send's writes all finished or failed: (done, owed). `done`: the last send was queued
        and no send is in flight any more, so decode may read every page; `owed`: the room failed
        earlier and decode must now hear that it is quiesced.

        Both are decided here, under the lock `queue_send` counts under: a `done` read after it (the
        last send queued by the scheduler's thread between this count and that read) would tell decode
        Success while the last pages and the first token are still on the wire."""
        with self.lock:
            self.inflight -= 1
            self.nbytes += nbytes
            quiet = self.inflight == 0
            owed, self.owes_quiesced = self.owes_quiesced and quiet, self.owes_quiesced and not quiet
            done = quiet and self.last_queued
        return done, owed


@dataclass
class SendJob:
    """One send() of a room, handled by the transfer thread of its decode peer."""

    room: PrefillRoom
    peer: DecodePeer
    request: RoomRequest
    src_pages: list[int]
    dst_pages: list[int]
    last: bool
    first: bool  # the room's first send: decode is told it moved to Transferring unless it ends at once
    first_index: int = 0  # position of src_pages[0] in the room's destination
    buffers: list[int] | None = None  # the local KV buffers to write (None: all; a layer group's, `layerwise`)
    ready: Any = None  # a CUDA event the pages' KV is written by (a streamed group's); None: written already
    stream: StreamRound | None = None  # the forward a streamed group belongs to (its metrics)
    queued_at: float = field(default_factory=time.monotonic)
    group: WriteGroup = field(default_factory=lambda: WriteGroup([], 0))  # planned when the thread starts it
    staged: tuple[int, int] | None = None  # (offset, nbytes) held in the local staging area

    def notice_due(self) -> bool:
        """The room's first send, on the wire long enough that decode should hear of it."""
        return self.first and time.monotonic() - self.group.started > TUNING.transfer.transferring_notice_s
