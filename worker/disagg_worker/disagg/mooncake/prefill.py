"""Prefill side of the `mooncake` backend: the control protocol of its rooms.

Threads: `control` (zmq: decode hellos, room requests and aborts; timeouts; registration with
the bootstrap server) and the transfer threads of `PrefillWrites` (one per decode peer: write
planning, the per-peer budget, staging). The scheduler thread only calls non-blocking handle
methods; what its sends become (their checks, one job per decode rank) is `PrefillSends`' business
(`prefill_sends`).

Protocol: a `DecodeHello` (once per decode rank) says where that rank's pool lives
(`DecodePeer`); a `RoomRequest` names one room's destination pages and the KV heads that decode
rank wants, and may arrive before the scheduler created the room's sender (it then waits for it,
up to the bootstrap timeout). When decode has more TP ranks than prefill, several decode ranks
ask for the same room (`decode_ranks`), each for its slice of this rank's heads: the room waits
for all of them, and each send is written to each. Prefill answers every request with
`RoomUpdate`s: Transferring (a notice for a first send still on the wire after a while), Success
(carrying the aux record) or Failed.

Timeouts: a sender still Bootstrapping after `bootstrap_timeout_s` fails; a send whose writes
have not all landed after `waiting_timeout_s` fails. Such writes are not cancelled, so decode
is told `quiesced=False` and gets a second Failed update with `quiesced=True` once every
write of the room has settled; only then may it reuse the pages.

Peers (`peer_book`): a decode incarnation that says hello from the address of an earlier one
(a restarted decode) replaces it, and the earlier one's rooms fail at once; a peer silent for
`TUNING.transfer.peer_idle_s` with nothing in flight is forgotten, and its transfer thread and
control socket are released.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from disagg_worker import keys
from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout, KVManager, KVSender, RankInfo
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.bootstrap_client import BootstrapError, register_rank
from disagg_worker.disagg.channel import ControlChannel
from disagg_worker.disagg.layerwise import LayerStream
from disagg_worker.disagg.messages import DecodeHello, Message, RoomAbort, RoomRequest, RoomUpdate
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.disagg.mooncake.peer_book import KnownPeer, PeerBook
from disagg_worker.disagg.mooncake.prefill_room import PrefillRoom, SendJob
from disagg_worker.disagg.mooncake.prefill_sends import PrefillSends
from disagg_worker.disagg.mooncake.prefill_writes import PrefillWrites
from disagg_worker.disagg.mooncake.staging import open_registered
from disagg_worker.disagg.poll import KVPoll
from disagg_worker.disagg.rooms import RoomTable
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)


class PrefillSender(KVSender):
    def __init__(self, state: PrefillRoom, sends: PrefillSends, fail: Callable[[PrefillRoom, str], None]):
        self.room = state.room
        self._state = state
        self._sends, self._fail = sends, fail

    def poll(self) -> KVPoll:
        return self._state.cell.get()

    def send(self, page_indices: list[int], last: bool, aux: bytes | None = None) -> None:
        self._sends.send(self._state, list(page_indices), last, aux or b"")

    def stream(self, page_indices: list[int]) -> None:
        self._sends.stream(self._state, list(page_indices))

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._fail(self._state, reason)

    def failure_reason(self) -> str:
        return self._state.cell.reason

    def peers(self) -> list[str]:
        return [peer.session_id for peer, _ in list(self._state.dests)]


class MooncakePrefillManager(KVManager):
    def __init__(self, cfg: DisaggConfig, layout: KVLayout, rank: RankInfo, metrics: TransferMetrics):
        super().__init__(cfg, layout, rank, metrics)
        self.engine, buffers, staging = open_registered(cfg, layout)
        self.writes = PrefillWrites(
            self.engine,
            layout,
            buffers,
            staging,
            on_failed=self._write_failed,
            on_notice=self._still_transferring,
            on_settled=self._send_settled,
        )
        port = cfg.control_port_of(cfg.rank_index(rank.tp_rank, rank.pp_rank, rank.dp_rank))
        self.channel = ControlChannel(cfg.advertise_host, port, keys.control_key(cfg.auth_token))
        self.rooms: RoomTable[PrefillRoom] = RoomTable()
        self._peers = PeerBook()  # decode ranks by decode id, from hellos (control thread)
        self._early: dict[int, tuple[float, list[RoomRequest]]] = {}  # requests that came before their sender
        self._early_lock = threading.Lock()
        self._stop = threading.Event()
        self.registered = threading.Event()
        if cfg.layer_pipeline:
            cuda = bool(layout.buffers) and layout.buffers[0].device.type == "cuda"
            stall = cfg.fault_stall_after_layer_group
            self.layer_stream = LayerStream(layout.model_layers, cfg.layer_group_size, metrics, cuda, stall)
        self.sends = PrefillSends(layout, cfg.waiting_timeout_s, self.writes.put, self.fail, self.layer_stream)
        self._control = self.supervise(self._control_loop, "kv-prefill-control")

    def registration(self) -> RankRegistration:
        cfg, lay = self.cfg, self.layout
        return RankRegistration(
            tp_rank=self.rank.tp_rank,
            tp_size=cfg.attn_tp_size,
            pp_rank=self.rank.pp_rank,
            pp_size=cfg.pp_size,
            dp_rank=self.rank.dp_rank,
            dp_size=cfg.dp_size,
            rank_ip=cfg.advertise_host,
            rank_port=self.channel.port,
            page_size=lay.page_size,
            kv_dtype=lay.kv_dtype,
            session_id=self.engine.session_id,
            start_layer=lay.start_layer,
            num_layers=lay.num_layers,
            kv_head_start=lay.kv_head_start,
            num_kv_heads=lay.num_kv_heads,
            head_nbytes=lay.head_nbytes,
            kv_kind=lay.kind.value,
            draft_kv=lay.draft_kv,
        )

    # ---- scheduler-facing ------------------------------------------------------------
    def create_sender(self, room: int) -> KVSender:
        state = PrefillRoom(room, self.new_cell())
        if not self.rooms.add(room, state):
            outcome = self.rooms.tombstone(room) or "in use"
            state.cell.fail(f"room {room} was already used on this instance ({outcome})")
            return PrefillSender(state, self.sends, self.fail)
        with self._early_lock:
            early = self._early.pop(room, None)
        for req in early[1] if early is not None else ():
            self._attach(state, req)
        return PrefillSender(state, self.sends, self.fail)

    def fail(self, state: PrefillRoom, reason: str) -> None:
        """Fail a room (any thread) and tell decode whether writes of it may still land."""
        if not state.cell.fail(reason):
            return
        if state.first_send:
            self.metrics.transfer_failed()
        else:
            self.metrics.bootstrap_failed()
        self.rooms.retire(state.room, f"failed: {reason}")
        if state.requests:
            self._tell_all(state, KVPoll.Failed, reason, quiesced=state.quiet_on_failure())

    @property
    def known_peers(self) -> int:
        """Decode ranks this rank holds state for (tests, diagnostics)."""
        return len(self._peers)

    def close(self) -> None:
        self._stop.set()
        for _, state in self.rooms.snapshot():
            self.fail(state, "prefill transfer manager closed")
        self._control.join(timeout=5)
        self.writes.close()
        self.channel.close()

    def _tell(self, req: RoomRequest, status: KVPoll, reason: str, quiesced: bool, aux: bytes = b"") -> None:
        """Send decode a `RoomUpdate` for the room of `req`."""
        update = RoomUpdate(
            room=req.room,
            tp_rank=self.rank.tp_rank,
            pp_rank=self.rank.pp_rank,
            status=int(status),
            reason=reason,
            quiesced=quiesced,
            aux=aux,
        )
        self.channel.send(req.reply_endpoint, update)

    def _tell_all(self, state: PrefillRoom, status: KVPoll, reason: str, quiesced: bool, aux: bytes = b"") -> None:
        """Send every decode rank that asked for the room a `RoomUpdate`."""
        for req in list(state.requests):
            self._tell(req, status, reason, quiesced, aux)

    # ---- control thread --------------------------------------------------------------
    def _control_loop(self) -> None:
        interval_ms = TUNING.transfer.sweep_interval_ms
        next_register = next_sweep = next_idle = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if not self.registered.is_set() and now >= next_register:
                next_register = now + self._try_register()
            for msg in self.channel.recv(timeout_ms=interval_ms):
                try:
                    self._on_message(msg)
                except Exception:  # one message's failure never ends the thread every room depends on
                    log.exception("handling a %s failed", type(msg).__name__)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + interval_ms / 1000
            if now >= next_idle:
                self._forget_idle_peers(now)
                next_idle = now + TUNING.transfer.peer_check_interval_s

    def _try_register(self) -> float:
        """Register with the bootstrap server; seconds until the next attempt."""
        url = self.rank.bootstrap_url or f"http://127.0.0.1:{self.cfg.bootstrap_port}"
        try:
            register_rank(url, self.registration(), self.cfg.bootstrap_token)
        except BootstrapError as e:
            log.error("bootstrap registration refused: %s", e)
            return TUNING.transfer.register_refused_retry_s
        except OSError:
            return TUNING.transfer.register_retry_s
        self.registered.set()
        return 0.0

    def _on_message(self, msg: Message) -> None:
        now = time.monotonic()
        if isinstance(msg, DecodeHello):
            for old in self._peers.hello(msg, self.layout, now):
                log.warning("decode %s restarted (instance %s replaces %s)", old.endpoint, msg.decode_id, old.decode_id)
                self._forget(old, "decode restarted: a new instance said hello from its address")
        elif isinstance(msg, RoomRequest):
            self._peers.seen(msg.decode_id, now)
            self._on_request(msg)
        elif isinstance(msg, RoomAbort):
            self._peers.seen(msg.decode_id, now)
            self._on_abort(msg)

    def _forget(self, old: KnownPeer, reason: str) -> None:
        """Drop a decode incarnation: fail its rooms, release its socket and transfer thread unless
        its successor uses them."""
        for _, state in self.rooms.snapshot():
            if any(req.decode_id == old.decode_id for req in state.requests):
                self.fail(state, reason)
        with self._early_lock:
            for room in [r for r, (_, reqs) in self._early.items() if any(q.decode_id == old.decode_id for q in reqs)]:
                del self._early[room]
        self._release(old)

    def _release(self, old: KnownPeer) -> None:
        if not self._peers.uses(endpoint=old.endpoint):
            self.channel.forget(old.endpoint)
        if not self._peers.uses(session_id=old.peer.session_id):
            self.writes.forget(old.peer.session_id)

    def _forget_idle_peers(self, now: float) -> None:
        """Release peers silent for `peer_idle_s` with no live room, early request or write in flight."""
        busy = {req.decode_id for _, state in self.rooms.snapshot() for req in state.requests}
        with self._early_lock:
            busy |= {q.decode_id for _, reqs in self._early.values() for q in reqs}
        busy |= {k.decode_id for k in self._peers.known() if self.writes.busy(k.peer.session_id)}
        for old in self._peers.idle(now, TUNING.transfer.peer_idle_s, busy):
            self._release(old)

    def _on_abort(self, msg: RoomAbort) -> None:
        reason = f"aborted by decode: {msg.reason}"
        state = self.rooms.get(msg.room)
        if state is not None:
            self.fail(state, reason)
        else:  # the sender may not exist yet: its room must never start
            self.rooms.retire(msg.room, reason)
        with self._early_lock:
            early = self._early.pop(msg.room, None)
        for req in early[1] if early is not None else ():  # nothing was written: decode may reuse its pages
            self._tell(req, KVPoll.Failed, "aborted by decode before prefill started it", quiesced=True)

    def _on_request(self, req: RoomRequest) -> None:
        state = self.rooms.get(req.room)
        if state is not None:
            self._attach(state, req)
            return
        outcome = self.rooms.tombstone(req.room)
        if outcome is not None:  # late request for a finished room: refuse, never reuse
            self._tell(req, KVPoll.Failed, f"room already finished on prefill ({outcome})", quiesced=True)
            return
        with self._early_lock:
            self._early.setdefault(req.room, (time.monotonic(), []))[1].append(req)

    def _attach(self, state: PrefillRoom, req: RoomRequest) -> None:
        peer = self._peers.get(req.decode_id)
        state.requests.append(req)
        if state.cell.get() is KVPoll.Failed:
            # Failed (on another thread) before this request arrived: `fail` may not have seen it,
            # so tell decode here. Nothing was sent to it, so its pages are safe at once.
            self._tell(req, KVPoll.Failed, state.cell.reason, quiesced=True)
            return
        if peer is None:
            self.fail(state, f"no handshake from decode {req.decode_id}")
        elif peer.error:
            self.fail(state, peer.error)
        elif bad := peer.check_dest(req, self.layout) or state.check_request(req):
            self.fail(state, bad)
        else:
            state.dests.append((peer, req))
            if state.ready:
                state.cell.advance(KVPoll.WaitingForInput)

    def _sweep(self, now: float) -> None:
        """Timeouts are enforced here, not in the transfer threads: a call into the engine
        may block for a frozen peer."""
        limit = self.cfg.bootstrap_timeout_s
        for _, state in self.rooms.snapshot():
            status = state.cell.get()
            if status is KVPoll.Bootstrapping and now - state.created > limit:
                self.fail(state, f"decode did not send its destination within {limit:g}s (bootstrap timeout)")
            elif status is KVPoll.Transferring and now > state.deadline:
                wait = self.cfg.waiting_timeout_s
                self.fail(state, f"KV transfer timed out after {wait:g}s (writes not cancelled)")
        with self._early_lock:
            stale = [room for room, (t, _) in self._early.items() if now - t > limit]
            requests = [req for room in stale for req in self._early.pop(room)[1]]
        for req in requests:
            self._tell(req, KVPoll.Failed, "prefill never received this request", quiesced=True)

    # ---- reports from the transfer threads ---------------------------------------------
    def _write_failed(self, job: SendJob) -> None:
        self.fail(job.room, "KV write to decode failed (decode gone or refused the address)")

    def _still_transferring(self, job: SendJob) -> None:
        if job.room.cell.get() is KVPoll.Transferring:
            self._tell(job.request, KVPoll.Transferring, "", quiesced=False)

    def _send_settled(self, job: SendJob) -> None:
        state = job.room
        if job.stream is not None:
            job.stream.settled(job.queued_at)
        done, owed = state.settle_send(job.group.nbytes)
        if owed:  # the last write of a failed room settled: decode may reuse its pages now
            self._tell_all(state, KVPoll.Failed, state.cell.reason, quiesced=True)
        elif done and state.cell.get() is KVPoll.Transferring:
            self._finish(state)

    def _finish(self, state: PrefillRoom) -> None:
        # Decode's first token waits on this notice: send it before the move wakes this
        # instance's scheduler, which would take the GIL for its own bookkeeping first.
        notify = functools.partial(self._tell_all, state, KVPoll.Success, "", True, state.aux)
        if state.cell.advance(KVPoll.Success, then=notify):
            self.rooms.retire(state.room, "success")
            self.metrics.transfer_done(state.nbytes, time.monotonic() - state.first_send)
