"""Prefill side of the `mooncake` backend.

Threads: `control` (zmq: decode hellos, room requests and aborts; timeouts; registration
with the bootstrap server) and one transfer thread per decode peer (`TransferWorkers`:
submits the writes of each send, at most `MAX_WRITES_IN_FLIGHT` outstanding per peer, and
polls them with a short sleep). The scheduler thread only calls non-blocking handle methods.

Writes: contiguous page runs go straight from the pool into decode's pool, large ones split
over a few lanes (`runs.split_for_lanes`) when nothing else is in flight to that peer. When
decode names a staging range for a room (its destination is fragmented), each send is gathered
into the local staging area and written as one block per KV buffer; decode scatters it before
Success (`mooncake_staging`).

Timeouts: a sender still Bootstrapping after `bootstrap_timeout_s` fails; a send whose writes
have not all landed after `waiting_timeout_s` fails. Such writes are not cancelled, so decode
is told `quiesced=False` and gets a second Failed update with `quiesced=True` once every
write of the room has settled; only then may it reuse the pages.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout, KVManager, KVSender, RankInfo, check_pages
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.bootstrap_client import BootstrapError, register_rank
from disagg_worker.disagg.channel import SWEEP_INTERVAL_MS, ControlChannel
from disagg_worker.disagg.messages import DecodeHello, RoomAbort, RoomRequest, RoomUpdate
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.disagg.mooncake import MAX_WRITES_IN_FLIGHT, WriteGroup, WriteState
from disagg_worker.disagg.mooncake_staging import gather, open_registered
from disagg_worker.disagg.peers import DecodePeer
from disagg_worker.disagg.poll import KVPoll, StatusCell
from disagg_worker.disagg.rooms import RoomTable
from disagg_worker.disagg.runs import LANES, group_runs, split_for_lanes
from disagg_worker.disagg.transfer_workers import Progress, TransferWorkers
from disagg_worker.env import load_env

log = logging.getLogger(__name__)
# Decode hears "Transferring" only for sends still in flight after this long. The notice is
# informational and costs a control message on both sides (~0.2 ms of CPU): long enough a
# wait keeps it under 1% of the transfer it describes. With 5 ms, rooms streaming behind
# each other each sent one, and streamed 1 MiB rooms moved ~5% slower.
TRANSFERRING_NOTICE_S = 0.05


@dataclass
class _Room:
    room: int
    cell: StatusCell = field(default_factory=StatusCell)
    created: float = field(default_factory=time.monotonic)
    peer: DecodePeer | None = None
    request: RoomRequest | None = None
    sent: int = 0  # destination pages consumed by send() so far
    inflight: int = 0  # write groups submitted or queued and not yet settled
    last_queued: bool = False
    nbytes: int = 0
    first_send: float = 0.0
    aux: bytes = b""
    owes_quiesced: bool = False  # decode was told Failed while writes were still in flight
    deadline: float = 0.0  # all queued writes must have landed by then (waiting timeout)


@dataclass
class _Job:
    state: _Room
    src_pages: list[int]
    dst_pages: list[int]
    last: bool
    first: bool  # the room's first send: decode is told it moved to Transferring unless it ends at once
    first_index: int = 0  # position of src_pages[0] in the room's destination
    group: WriteGroup | None = None
    staged: tuple[int, int] | None = None  # (offset, nbytes) held in the local staging area


class PrefillSender(KVSender):
    def __init__(self, mgr: MooncakePrefillManager, state: _Room):
        self.room = state.room
        self._mgr = mgr
        self._state = state

    def poll(self) -> KVPoll:
        return self._state.cell.get()

    def send(self, page_indices: list[int], last: bool, aux: bytes | None = None) -> None:
        self._mgr._send(self._state, list(page_indices), last, aux or b"")

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._mgr._fail(self._state, reason)

    def failure_reason(self) -> str:
        return self._state.cell.reason


class MooncakePrefillManager(KVManager):
    def __init__(self, cfg: DisaggConfig, layout: KVLayout, rank: RankInfo, metrics: TransferMetrics):
        super().__init__(cfg, layout, rank, metrics)
        self._token = load_env().auth_token
        self.engine, self._buffers, self.staging = open_registered(cfg, layout)
        self.channel = ControlChannel("0.0.0.0", cfg.advertise_host)
        self.rooms: RoomTable[_Room] = RoomTable()
        self._peers: dict[str, DecodePeer] = {}
        self._early: dict[int, tuple[float, RoomRequest]] = {}  # requests before their sender
        self._workers: TransferWorkers[_Job] = TransferWorkers(self._start, self._progress)
        self._in_flight: dict[str, int] = {}  # writes submitted and not yet settled, per decode session
        self._lock = threading.Lock()  # guards _Room.inflight/last_queued and _early
        self._stop = threading.Event()
        self.registered = threading.Event()
        self._control = threading.Thread(target=self._control_loop, name="kv-prefill-control", daemon=True)
        self._control.start()

    def registration(self) -> RankRegistration:
        cfg, lay = self.cfg, self.layout
        return RankRegistration(
            self.rank.tp_rank, cfg.tp_size, self.rank.pp_rank, cfg.pp_size, cfg.advertise_host,
            self.channel.port, lay.page_size, lay.kv_dtype, self.engine.session_id,
            lay.start_layer, lay.num_layers,
        )  # fmt: skip

    # ---- scheduler-facing ------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        state = _Room(room, self.new_cell())
        if not self.rooms.add(room, state):
            outcome = self.rooms.tombstone(room) or "in use"
            state.cell.fail(f"room {room} was already used on this instance ({outcome})")
            return PrefillSender(self, state)
        with self._lock:
            early = self._early.pop(room, None)
        if early is not None:
            self._attach(state, early[1])
        return PrefillSender(self, state)

    def _send(self, state: _Room, pages: list[int], last: bool, aux: bytes) -> None:
        status = state.cell.get()
        if status is KVPoll.Failed:
            return
        if status < KVPoll.WaitingForInput or state.request is None or state.last_queued:
            self._fail(
                state, f"send() in status {status.name}" + (" after the last chunk" if state.last_queued else "")
            )
            return
        dest = state.request.dest_pages
        problem = check_pages(pages, self.layout.num_pages)
        if state.sent + len(pages) > len(dest):
            problem = f"{state.sent + len(pages)} pages sent but decode allocated {len(dest)}"
        if last and len(aux) > state.peer.aux_item_nbytes:
            problem = f"aux record of {len(aux)} bytes exceeds decode's {state.peer.aux_item_nbytes}"
        if problem:
            self._fail(state, problem)
            return
        first_index = state.sent
        dst = dest[first_index : first_index + len(pages)]
        with self._lock:
            state.sent += len(pages)
            state.inflight += 1
            state.last_queued = last
            state.aux = aux if last else state.aux
            state.first_send = state.first_send or time.monotonic()
            state.deadline = time.monotonic() + self.cfg.waiting_timeout_s
        first = state.cell.advance(KVPoll.Transferring)
        self._workers.put(state.peer.session_id, _Job(state, pages, dst, last, first, first_index))

    def _fail(self, state: _Room, reason: str, notify: bool = True) -> None:
        if not state.cell.fail(reason):
            return
        if state.first_send:
            self.metrics.transfer_failed()
        else:
            self.metrics.bootstrap_failed()
        self.rooms.retire(state.room, f"failed: {reason}")
        if notify and state.request is not None:
            with self._lock:
                quiet = state.inflight == 0
                state.owes_quiesced = not quiet
            self._update(state, KVPoll.Failed, reason, quiet)

    def _update(self, state: _Room, status: KVPoll, reason: str, quiesced: bool, aux: bytes = b"") -> None:
        msg = RoomUpdate(state.room, self.rank.tp_rank, self.rank.pp_rank, int(status), reason, quiesced, aux)
        self.channel.send(state.request.reply_endpoint, msg)

    def close(self) -> None:
        self._stop.set()
        for _, state in self.rooms.snapshot():
            self._fail(state, "prefill transfer manager closed")
        self._control.join(timeout=5)
        self._workers.close()
        self.channel.close()

    # ---- control thread --------------------------------------------------------------
    def _control_loop(self) -> None:
        next_register = next_sweep = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if not self.registered.is_set() and now >= next_register:
                next_register = now + self._try_register()
            for msg in self.channel.recv(timeout_ms=SWEEP_INTERVAL_MS):
                self._on_message(msg)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + SWEEP_INTERVAL_MS / 1000

    def _try_register(self) -> float:
        """Register with the bootstrap server; seconds until the next attempt."""
        url = self.rank.bootstrap_url or f"http://127.0.0.1:{self.cfg.bootstrap_port}"
        try:
            register_rank(url, self.registration(), self._token)
        except BootstrapError as e:
            log.error("bootstrap registration refused: %s", e)
            return 5.0
        except OSError:
            return 0.2
        self.registered.set()
        return 0.0

    def _on_message(self, msg) -> None:
        if isinstance(msg, DecodeHello):
            self._peers[msg.decode_id] = DecodePeer.from_hello(msg, self.layout)
        elif isinstance(msg, RoomRequest):
            self._on_request(msg)
        elif isinstance(msg, RoomAbort):
            state = self.rooms.get(msg.room)
            if state is not None:
                self._fail(state, f"aborted by decode: {msg.reason}")
            else:  # the sender may not exist yet: its room must never start
                self.rooms.retire(msg.room, f"aborted by decode: {msg.reason}")
            with self._lock:
                early = self._early.pop(msg.room, None)
            if early is not None:  # nothing was written for it: decode may reuse its pages at once
                update = RoomUpdate(msg.room, self.rank.tp_rank, self.rank.pp_rank, int(KVPoll.Failed),
                                    "aborted by decode before prefill started it", True, b"")  # fmt: skip
                self.channel.send(early[1].reply_endpoint, update)

    def _on_request(self, req: RoomRequest) -> None:
        state = self.rooms.get(req.room)
        if state is None:
            outcome = self.rooms.tombstone(req.room)
            if outcome is not None:  # late request for a finished room: refuse, never reuse
                msg = RoomUpdate(req.room, self.rank.tp_rank, self.rank.pp_rank, int(KVPoll.Failed),
                                 f"room already finished on prefill ({outcome})", True, b"")  # fmt: skip
                self.channel.send(req.reply_endpoint, msg)
                return
            with self._lock:
                self._early[req.room] = (time.monotonic(), req)
            return
        self._attach(state, req)

    def _attach(self, state: _Room, req: RoomRequest) -> None:
        peer = self._peers.get(req.decode_id)
        state.request = req
        if state.cell.get() is KVPoll.Failed:
            # Failed (on another thread) before decode's request arrived: `_fail` may not have seen
            # the request, so tell decode here. Nothing was sent, so its pages are safe at once.
            self._update(state, KVPoll.Failed, state.cell.reason, True)
            return
        if peer is None:
            self._fail(state, f"no handshake from decode {req.decode_id}")
        elif peer.error:
            self._fail(state, peer.error)
        elif bad := peer.check_dest(req.dest_pages, req.aux_slot, req.staging_offset):
            self._fail(state, bad)
        else:
            state.peer = peer
            state.cell.advance(KVPoll.WaitingForInput)

    def _sweep(self, now: float) -> None:
        """Timeouts are enforced here, not in the transfer thread: a call into the engine
        may block for a frozen peer."""
        limit = self.cfg.bootstrap_timeout_s
        for _, state in self.rooms.snapshot():
            status = state.cell.get()
            if status is KVPoll.Bootstrapping and now - state.created > limit:
                self._fail(state, f"decode did not send its destination within {limit:g}s (bootstrap timeout)")
            elif status is KVPoll.Transferring and now > state.deadline:
                wait = self.cfg.waiting_timeout_s
                self._fail(state, f"KV transfer timed out after {wait:g}s (writes not cancelled)")
        with self._lock:
            stale = [(r, req) for r, (t, req) in self._early.items() if now - t > limit]
            for r, _ in stale:
                del self._early[r]
        for room, req in stale:
            msg = RoomUpdate(room, self.rank.tp_rank, self.rank.pp_rank, int(KVPoll.Failed),
                             "prefill never received this request", True, b"")  # fmt: skip
            self.channel.send(req.reply_endpoint, msg)

    # ---- transfer threads -----------------------------------------------------------
    def _start(self, job: _Job) -> None:
        state = job.state
        writes = self._writes(job) if state.cell.get() is not KVPoll.Failed else []
        job.group = WriteGroup(writes, sum(n for _, _, n in writes))
        self._submit(job)

    def _submit(self, job: _Job) -> None:
        """Submit as many of the job's writes as its peer's budget allows (transfer thread of that peer only)."""
        group, peer = job.group, job.state.peer.session_id
        if job.state.cell.get() is KVPoll.Failed:
            group.drop_unsubmitted()
        free = self._budget(peer)
        if free > 0 and not group.settled:
            self._in_flight[peer] = self._in_flight.get(peer, 0) + group.submit(self.engine, peer, free)

    def _budget(self, peer: str) -> int:
        """Writes that may still be submitted to `peer` now."""
        return MAX_WRITES_IN_FLIGHT - self._in_flight.get(peer, 0)

    def _writes(self, job: _Job) -> list[tuple[int, int, int]]:
        """(src address, dst address, nbytes) for every page run of a job, in every buffer. Large
        writes are split over Mooncake's lanes only when the link to the peer is idle: with other
        writes in flight the lanes are busy already, and more pieces only add per-write cost."""
        peer, pn, req = job.state.peer, self.layout.page_nbytes, job.state.request
        lanes = LANES if self._in_flight.get(peer.session_id, 0) == 0 else 1
        if req.staging_offset >= 0:
            return split_for_lanes(self._staged_writes(job), lanes)
        writes = []
        for src, dst, n in group_runs(job.src_pages, job.dst_pages):
            for i, ptr in enumerate(self.layout.buffer_ptrs):
                writes.append((ptr + src * pn, peer.buffer_ptrs[peer.buffer_map[i]] + dst * pn, n * pn))
        return split_for_lanes(writes, lanes)

    def _staged_writes(self, job: _Job) -> list[tuple[int, int, int]]:
        """Writes into decode's staging area: one block per buffer gathered through the local
        staging area, or page runs straight from the pool when it is full."""
        peer, pn, req = job.state.peer, self.layout.page_nbytes, job.state.request
        n_dest, m = len(req.dest_pages), len(job.src_pages)
        block = m * pn
        off = self.staging.alloc(block * len(self._buffers))
        if off >= 0:
            job.staged = (off, block * len(self._buffers))
            writes = []
            for i, buf in enumerate(self._buffers):
                gather(buf, pn, job.src_pages, self.staging.view(off + i * block, block))
                dst = peer.staged_dst(req.staging_offset, n_dest, i, job.first_index)
                writes.append((self.staging.ptr + off + i * block, dst, block))
            return writes
        index = list(range(job.first_index, job.first_index + m))
        return [(ptr + src * pn, peer.staged_dst(req.staging_offset, n_dest, i, j), n * pn)
                for src, j, n in group_runs(job.src_pages, index)
                for i, ptr in enumerate(self.layout.buffer_ptrs)]  # fmt: skip

    def _progress(self, job: _Job) -> Progress:
        """Advance one job: poll its writes, submit more, tell decode what it must hear."""
        state, group = job.state, job.group
        peer, in_flight = state.peer.session_id, group.in_flight
        polled = group.poll(self.engine)
        unchanged = polled is WriteState.PENDING and group.in_flight == in_flight
        if unchanged and (group.all_submitted or self._budget(peer) <= 0) and not _notice_due(job):
            return Progress.WAITING  # the common case while writes are on the wire
        failed = polled is WriteState.FAILED
        self._in_flight[peer] = self._in_flight.get(peer, 0) - (in_flight - group.in_flight)
        if failed:
            self._fail(state, "KV write to decode failed (decode gone or refused the address)")
        self._submit(job)
        if group.settled and job.staged is not None:
            self.staging.free(*job.staged)
            job.staged = None
        if not group.settled:
            if _notice_due(job):
                job.first = False  # informational: a short send skips it, no CPU taken from the writes
                if state.cell.get() is KVPoll.Transferring:
                    self._update(state, KVPoll.Transferring, "", False)
            return Progress.MOVED
        with self._lock:
            state.inflight -= 1
            state.nbytes += group.nbytes
            quiet = state.inflight == 0
            owed, state.owes_quiesced = state.owes_quiesced and quiet, state.owes_quiesced and not quiet
        if owed:  # the last write of a failed room settled: decode may reuse its pages now
            self._update(state, KVPoll.Failed, state.cell.reason, True)
        elif quiet and state.last_queued and state.cell.get() is KVPoll.Transferring:
            self._finish(state)
        return Progress.SETTLED

    def _finish(self, state: _Room) -> None:
        # Decode's first token waits on this notice: send it before the move wakes this
        # instance's scheduler, which would take the GIL for its own bookkeeping first.
        notify = functools.partial(self._update, state, KVPoll.Success, "", True, state.aux)
        if state.cell.advance(KVPoll.Success, then=notify):
            self.rooms.retire(state.room, "success")
            self.metrics.transfer_done(state.nbytes, time.monotonic() - state.first_send)


def _notice_due(job: _Job) -> bool:
    """The job is its room's first send and has been on the wire long enough to tell decode."""
    return job.first and time.monotonic() - job.group.started > TRANSFERRING_NOTICE_S
