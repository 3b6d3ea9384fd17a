"""Decode side of the `mooncake` backend.

Per prefill instance (bootstrap address): resolve the topology once, check compatibility and map it
(`decode_resolve`, `mapping`: which prefill ranks, heads and layers feed this rank; a mismatch fails
the instance's rooms at once with its message), send a `DecodeHello` to each target rank, then watch
it with heartbeats. Per room: send each target rank a `RoomRequest` (with the head slice wanted from
it) after `init()` and the handshake; apply `RoomUpdate`s from prefill; Success once every target
reported it; its waiting timeout counts from that request (resolving the instance has a deadline of
its own, as long). Threads: `control` (zmq updates, waiting timeouts), a resolver pool (blocking
HTTP), heartbeat.

A room whose destination is fragmented is staged (`staging`): prefill writes it into a range of
this rank's registered staging area, and it is scattered into its pages before Success. So is a
head slice that is only part of this rank's heads (`slices`): one range per slice.

A failed room's pages that prefill may still write are quarantined until prefill says it is quiet,
its instance is known dead, or `cfg.quarantine_limit_s` passed (a silent prefill is declared dead).
`decode_id` is new per process (prefill tells a restarted decode at the same address from the old
one); a rank sent nothing for `hello_refresh_s` is greeted again before a request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from disagg_worker import keys
from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout, KVManager, KVReceiver, RankInfo, TransferFailure, check_pages
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.channel import ControlChannel
from disagg_worker.disagg.heartbeat import HeartbeatMonitor
from disagg_worker.disagg.mapping import Target
from disagg_worker.disagg.messages import RoomAbort, RoomRequest, RoomUpdate
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.disagg.mooncake.decode_resolve import decode_hello, resolve
from disagg_worker.disagg.mooncake.decode_state import DecodeInstance, DecodeRoom, InstanceState
from disagg_worker.disagg.mooncake.slices import reserve_staging, unstage
from disagg_worker.disagg.mooncake.staging import open_registered
from disagg_worker.disagg.poll import KVPoll
from disagg_worker.disagg.rooms import RoomTable
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)


class DecodeReceiver(KVReceiver):
    def __init__(self, mgr: MooncakeDecodeManager, state: DecodeRoom):
        self.room = state.room
        self._mgr = mgr
        self._state = state

    def poll(self) -> KVPoll:
        return self._state.cell.get()

    def init(self, dest_pages: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        self._mgr.init_room(self._state, list(dest_pages), aux_slot, skip_pages)

    def abort(self, reason: str = "aborted by decode") -> None:
        self._mgr.fail(self._state, reason)

    def failure(self) -> TransferFailure | None:
        if self._state.cell.get() is not KVPoll.Failed:
            return None
        return TransferFailure(reason=self._state.cell.reason, pages_unsafe=self._state.unsafe)

    def aux_bytes(self) -> bytes:
        return self._mgr.read_aux(self._state.aux_slot)


class MooncakeDecodeManager(KVManager):
    def __init__(self, cfg: DisaggConfig, layout: KVLayout, rank: RankInfo, metrics: TransferMetrics):
        super().__init__(cfg, layout, rank, metrics)
        self.engine, self._buffers, self.staging = open_registered(cfg, layout)
        self.aux = torch.zeros(layout.aux_num_slots * layout.aux_item_nbytes, dtype=torch.uint8)
        self.decode_id = uuid.uuid4().hex
        port = cfg.control_port_of(cfg.rank_index(rank.tp_rank, rank.pp_rank, rank.dp_rank))
        self.channel = ControlChannel(cfg.advertise_host, port, keys.control_key(cfg.auth_token))
        self.rooms: RoomTable[DecodeRoom] = RoomTable()
        self._quarantine: dict[int, DecodeRoom] = {}  # failed rooms whose pages prefill may still write
        self._instances: dict[str, DecodeInstance] = {}
        self._last_sent: dict[str, float] = {}  # prefill rank endpoint -> last hello or request sent there
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._resolver = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-resolve")
        self.heartbeat = HeartbeatMonitor(
            cfg.heartbeat_interval_s, cfg.heartbeat_max_misses, self._on_lost, self.confirm_instance_dead
        )
        self._control = self.supervise(self._control_loop, "kv-decode-control")

    # ---- scheduler-facing ------------------------------------------------------------
    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        state = DecodeRoom(room, bootstrap_addr, self.new_cell())
        if not self.rooms.add(room, state):
            state.cell.fail(f"room {room} was already used on this instance")
            return DecodeReceiver(self, state)
        with self._lock:
            inst = self._instances.get(bootstrap_addr)
            if inst is None:
                inst = self._instances[bootstrap_addr] = DecodeInstance(bootstrap_addr)
                self._resolver.submit(self._resolve_or_fail, inst)
            inst.rooms.add(room)
            if inst.state is InstanceState.READY:
                state.cell.advance(KVPoll.WaitingForInput)
        return DecodeReceiver(self, state)

    def read_aux(self, slot: int) -> bytes:
        n = self.layout.aux_item_nbytes
        return bytes(self.aux[slot * n : (slot + 1) * n].numpy())

    def confirm_instance_dead(self, bootstrap_addr: str) -> None:
        with self._lock:
            safe = [state for state in self._quarantine.values() if state.addr == bootstrap_addr]
            for state in safe:
                self._unquarantine(state)
        if safe:
            self.on_change()  # their pages are free now

    def close(self) -> None:
        self._stop.set()
        for _, state in self.rooms.snapshot():
            self.fail(state, "decode transfer manager closed")
        self.heartbeat.close()
        self._resolver.shutdown(wait=False, cancel_futures=True)
        self._control.join(timeout=5)
        self.channel.close()

    def init_room(self, state: DecodeRoom, dest: list[int], aux_slot: int, skip_pages: int = 0) -> None:
        """`DecodeReceiver.init`: check the destination, reserve staging if it is fragmented, and
        send it to prefill once the instance is resolved."""
        if state.cell.get() is KVPoll.Failed:
            return
        problem = check_pages(dest, self.layout.num_pages)
        if not 0 <= aux_slot < self.layout.aux_num_slots:
            problem = problem or f"aux slot {aux_slot} outside [0, {self.layout.aux_num_slots})"
        if state.inited:
            problem = problem or "init() called twice"
        if skip_pages < 0:
            problem = problem or f"skip_pages {skip_pages} is negative"
        if problem:
            self.fail(state, problem)
            return
        with self._lock:
            state.dest_pages, state.aux_slot, state.init_at = dest, aux_slot, time.monotonic()
            state.skip_pages = skip_pages
            inst = self._instances.get(state.addr)
            if inst is not None and inst.state is InstanceState.READY:
                self._request(state, inst)

    def _request(self, state: DecodeRoom, inst: DecodeInstance) -> None:
        """Send the destination to every target rank (under the lock, once)."""
        state.targets = [(t.tp_rank, t.pp_rank) for t in inst.targets]
        state.asked_at = time.monotonic()
        offsets, state.staged = reserve_staging(inst.targets, self.layout, state.dest_pages, self.staging.alloc)
        for t, offset in zip(inst.targets, offsets, strict=True):
            self._greet_if_stale(inst, _endpoint(t.rank))
            msg = RoomRequest(
                decode_id=self.decode_id,
                reply_endpoint=self.channel.endpoint,
                room=state.room,
                dest_pages=state.dest_pages,
                aux_slot=state.aux_slot,
                staging_offset=offset,
                src_head=t.heads.src,
                dst_head=t.heads.dst,
                num_heads=-1 if t.whole else t.heads.count,
                decode_ranks=t.decode_ranks,
                skip_pages=state.skip_pages,
            )
            self.channel.send(_endpoint(t.rank), msg)

    def _greet_if_stale(self, inst: DecodeInstance, endpoint: str) -> None:
        """Greet again a prefill rank sent nothing for a while (it forgets silent peers); under the lock.
        The hello travels on the request's socket, so it arrives first."""
        now = time.monotonic()
        if inst.hello is not None and now - self._last_sent.get(endpoint, now) > TUNING.transfer.hello_refresh_s:
            self.channel.send(endpoint, inst.hello)
        self._last_sent[endpoint] = now

    def fail(self, state: DecodeRoom, reason: str, tell_prefill: bool = True) -> None:
        """Fail a room (any thread): quarantine its pages while prefill may still write them."""
        with self._lock, state.lock:  # unsafe is known before anyone can see Failed
            if state.cell.get().terminal:
                return
            state.unsafe = bool(state.targets) and not set(state.targets) <= state.quiesced
            state.failed_at = time.monotonic()
            state.cell.fail(reason)
            inst = self._instances.get(state.addr)
            if inst is not None:
                inst.rooms.discard(state.room)
            if state.unsafe:
                self._quarantine[state.room] = state
            else:
                self._release_staging(state)
        self.rooms.retire(state.room, "failed")
        with self._lock:
            targets = inst.targets if inst is not None and inst.state is InstanceState.READY else []
        if state.asked_at:
            self.metrics.transfer_failed()
        else:
            self.metrics.bootstrap_failed()
        if tell_prefill:
            for t in targets:
                self.channel.send(
                    _endpoint(t.rank), RoomAbort(decode_id=self.decode_id, room=state.room, reason=reason)
                )

    # ---- instance handling -------------------------------------------------------------
    def _resolve_or_fail(self, inst: DecodeInstance) -> None:
        """`_resolve` on the resolver pool, whose futures nobody reads: an error fails the instance's rooms."""
        try:
            self._resolve(inst)
        except Exception as e:  # a registration this process cannot connect to, a bug: never a room left waiting
            log.exception("resolving prefill instance %s failed", inst.addr)
            self._fail_instance(inst.addr, f"prefill instance {inst.addr}: {e!r}", dead=False)

    def _resolve(self, inst: DecodeInstance) -> None:
        instance_id, targets, error = resolve(inst.addr, self.cfg, self.layout, self.rank, self._stop)
        if error:
            self._fail_instance(inst.addr, f"prefill instance {inst.addr}: {error}", dead=False)
        else:
            self._ready(inst, instance_id, targets)

    def _ready(self, inst: DecodeInstance, instance_id: str, targets: list[Target]) -> None:
        hello = decode_hello(self.decode_id, self.channel.endpoint, self.engine.session_id, self.layout, self.staging)
        with self._lock:
            for t in targets:
                self.channel.send(_endpoint(t.rank), hello)
                self._last_sent[_endpoint(t.rank)] = time.monotonic()
            inst.state, inst.instance_id, inst.targets = InstanceState.READY, instance_id, targets
            inst.hello = hello
            for room in list(inst.rooms):
                state = self.rooms.get(room)
                if state is None:
                    continue
                state.cell.advance(KVPoll.WaitingForInput)
                if state.inited:
                    self._request(state, inst)
        self.heartbeat.watch(inst.addr, instance_id)

    def _on_lost(self, addr: str, reason: str, restarted: bool) -> None:
        self._fail_instance(addr, reason, dead=restarted)

    def _fail_instance(self, addr: str, reason: str, dead: bool) -> None:
        """Fail every room of an instance; the next receiver resolves it afresh."""
        with self._lock:
            inst = self._instances.pop(addr, None)
        if inst is None:
            return
        self.heartbeat.unwatch(addr)
        for room in list(inst.rooms):
            state = self.rooms.get(room)
            if state is not None:
                self.fail(state, reason, tell_prefill=False)
        if dead:
            self.confirm_instance_dead(addr)

    # ---- control thread --------------------------------------------------------------
    def _control_loop(self) -> None:
        interval_ms = TUNING.transfer.sweep_interval_ms
        next_sweep = 0.0
        while not self._stop.is_set():
            for msg in self.channel.recv(timeout_ms=interval_ms):
                try:
                    if isinstance(msg, RoomUpdate):
                        self._on_update(msg)
                except Exception:  # one message's failure never ends the thread every room depends on
                    log.exception("handling a %s failed", type(msg).__name__)
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + interval_ms / 1000

    def _on_update(self, msg: RoomUpdate) -> None:
        key = (msg.tp_rank, msg.pp_rank)
        with self._lock:
            state = self.rooms.get(msg.room) or self._quarantine.get(msg.room)
            if state is None or key not in state.targets:
                return  # late update for a room that is gone: dropped
            released = False
            if msg.quiesced:
                state.quiesced.add(key)
                released = state.unsafe and set(state.targets) <= state.quiesced
                if released:
                    self._unquarantine(state)
        if released:
            self.on_change()  # the room's pages left quarantine
        try:
            status = KVPoll(msg.status)
        except ValueError:
            status = KVPoll.Failed
        if status is KVPoll.Failed:
            self.fail(state, f"prefill failed: {msg.reason}")
        elif status is KVPoll.Transferring:
            state.cell.advance(KVPoll.Transferring)
        elif status is KVPoll.Success:
            self._on_success(state, key, msg.aux)

    def _on_success(self, state: DecodeRoom, key: tuple[int, int], aux: bytes) -> None:
        with state.lock:  # a failed room's pages and aux slot may already belong to another request
            if state.cell.get().terminal:
                return
            if aux:
                n = self.layout.aux_item_nbytes
                slot = self.aux[state.aux_slot * n : (state.aux_slot + 1) * n]
                slot.zero_()  # a record shorter than the slot's last one must not read that one's alternatives
                slot[: len(aux)] = torch.frombuffer(bytearray(aux), dtype=torch.uint8)
            state.done.add(key)
            if not set(state.targets) <= state.done:
                return
            if state.staged:
                self._unstage(state)
            succeeded = state.cell.advance(KVPoll.Success)
        if succeeded:
            self.rooms.retire(state.room, "success")
            with self._lock:
                inst = self._instances.get(state.addr)
                if inst is not None:
                    inst.rooms.discard(state.room)
            nbytes = len(state.dest_pages) * self.layout.page_nbytes * len(self.layout.buffer_ptrs)
            self.metrics.transfer_done(nbytes, time.monotonic() - state.asked_at)

    def _unstage(self, state: DecodeRoom) -> None:
        """Scatter a staged room into its destination pages and free its staging ranges."""
        for staged in state.staged:
            unstage(
                self.staging.view(staged.offset, staged.nbytes), staged, self.layout, self._buffers, state.dest_pages
            )
        self._release_staging(state)

    def _unquarantine(self, state: DecodeRoom) -> None:
        """Prefill can no longer write the room's pages (under the lock): they are safe to reuse."""
        state.unsafe = False
        self._quarantine.pop(state.room, None)
        self._release_staging(state)

    def _release_staging(self, state: DecodeRoom) -> None:
        for staged in state.staged:
            self.staging.free(staged.offset, staged.nbytes)
        state.staged = []

    def _sweep(self, now: float) -> None:
        limit = self.cfg.waiting_timeout_s
        for _, state in self.rooms.snapshot():
            if state.cell.get().terminal:
                continue
            if state.asked_at and now - state.asked_at > limit:
                self.fail(state, f"no KV from prefill within {limit:g}s (waiting timeout)")
            elif not state.asked_at and state.init_at and now - state.init_at > 2 * limit:  # backstop: resolving
                self.fail(state, f"prefill instance {state.addr} could not be asked for the KV within {2 * limit:g}s")
        self._expire_quarantine(now)

    def _expire_quarantine(self, now: float) -> None:
        """Release pages whose prefill stayed silent past the quarantine limit (declared dead; the limit
        outlasts the timeouts and liveness checks that end a frozen process)."""
        limit = self.cfg.quarantine_limit_s
        with self._lock:
            expired = [state for state in self._quarantine.values() if now - state.failed_at > limit]
            for state in expired:
                self._unquarantine(state)
        for state in expired:
            log.warning(
                "room %d: prefill %s silent for %.0fs: declared dead, pages reused", state.room, state.addr, limit
            )
        if expired:
            self.on_change()


def _endpoint(rank: RankRegistration) -> str:
    return f"tcp://{rank.rank_ip}:{rank.rank_port}"
