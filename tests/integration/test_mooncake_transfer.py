"""Real Mooncake TCP between two processes on 127.0.0.1: prefill (this process, with its
bootstrap server) writes KV pages into a decode process's pool."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from disagg_worker.config import DisaggConfig, Role  # noqa: E402
from disagg_worker.disagg import KVLayout, KVPoll, RankInfo, create_kv_manager, pack_first_token, unpack_first_token  # noqa: E402
from disagg_worker.disagg.bootstrap import BootstrapServer  # noqa: E402
from disagg_worker.disagg.mooncake.environ import mooncake_environ  # noqa: E402
from disagg_worker.disagg.mooncake.prefill import MooncakePrefillManager  # noqa: E402
from disagg_worker.env import load_env  # noqa: E402
from disagg_worker.mem.kv_pool import KVPool  # noqa: E402
from tests.integration.kv_ranks import Geometry, Pair  # noqa: E402
from tests.timing import scaled, wait_until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(scaled(180))]
SMALL = dict(num_layers=2, num_pages=64, page_size=4, num_kv_heads=2, head_dim=32)
_rooms = itertools.count(random.getrandbits(40) << 20)


@pytest.fixture(scope="module", autouse=True)
def mooncake_settings():
    """The transfer engine's environment, set as the scheduler process sets it before it builds an
    engine; the decode processes inherit it."""
    user = load_env().mc_tcp_lanes_per_peer
    with pytest.MonkeyPatch.context() as patch:
        for name, value in mooncake_environ(DisaggConfig(role=Role.PREFILL, mc_tcp_lanes_per_peer=user)).items():
            patch.setenv(name, value)
        yield


def with_transfer_tuning(module, **values) -> None:
    """Replace `module`'s view of the transfer tuning constants (in the process that calls it)."""
    from dataclasses import replace

    module.TUNING = replace(module.TUNING, transfer=replace(module.TUNING.transfer, **values))


def _decode_child(conn, pool_kw: dict, cfg_kw: dict, tuning: dict) -> None:
    """Decode side, driven by (command, *args) tuples over `conn`."""
    from disagg_worker.disagg.mooncake import decode as decode_module

    with_transfer_tuning(decode_module, **tuning)
    pool = KVPool(**pool_kw, dtype=torch.float32)
    layout = KVLayout.from_pool(pool, "float32")
    mgr = create_kv_manager(DisaggConfig(role=Role.DECODE, **cfg_kw), layout)
    receivers = {}
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "recv":
            room, addr, dest, slot, *skip = args  # skip: the room's first pages decode holds (its cache)
            receivers[room] = mgr.create_receiver(room, addr)
            receivers[room].init(dest, slot, *skip)
            conn.send(True)
        elif cmd == "wait":  # until terminal: (status, reason, pages_unsafe, seconds)
            room, timeout = args
            t0 = time.monotonic()
            r = receivers[room]
            while not r.poll().terminal and time.monotonic() - t0 < timeout:
                time.sleep(0.005)
            f = r.failure()
            conn.send((int(r.poll()), f.reason if f else "", f.pages_unsafe if f else False, time.monotonic() - t0))
        elif cmd == "unsafe":
            f = receivers[args[0]].failure()
            conn.send(f.pages_unsafe if f else None)
        elif cmd == "bytes":
            conn.send(pool.page_bytes(args[0]))
        elif cmd == "aux":
            conn.send(receivers[args[0]].aux_bytes())
        elif cmd == "abort":
            receivers[args[0]].abort(args[1])
            conn.send(True)
        elif cmd == "stop":
            mgr.close()
            conn.send(True)
            return


class DecodeProc:
    def __init__(self, pool_kw: dict, tuning: dict | None = None, **cfg_kw):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_child, args=(child, pool_kw, cfg_kw, tuning or {}), daemon=True)
        self.proc.start()
        assert self.conn.poll(scaled(60)) and self.conn.recv() == "ready", "decode process did not start"

    def __call__(self, *cmd, timeout: float = 60):
        """Run a command in the decode process; `timeout` (scaled) bounds its answer."""
        self.conn.send(cmd)
        assert self.conn.poll(scaled(timeout)), f"decode process did not answer {cmd[0]}"
        return self.conn.recv()

    def wait(self, room: int, timeout: float) -> tuple[int, str, bool, float]:
        """Until the room's receiver is terminal, at most `timeout` (scaled): (status, reason, pages_unsafe,
        seconds waited)."""
        return self("wait", room, scaled(timeout), timeout=timeout + 30)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None, "not started"
        return self.proc.pid

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("stop", timeout=10)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.kill()
        self.proc.join(scaled(5))


class Prefill:
    def __init__(self, pool_kw: dict, token: str = "", **cfg_kw):
        cfg = DisaggConfig(role=Role.PREFILL, auth_token=token, **cfg_kw)
        self.server = BootstrapServer(0, host="127.0.0.1", token=cfg.bootstrap_token).start()
        self.pool = KVPool(**pool_kw, dtype=torch.float32)
        for buf in self.pool.buffers():
            buf.copy_(torch.randn_like(buf))
        mgr = create_kv_manager(cfg, KVLayout.from_pool(self.pool, "float32"), RankInfo(bootstrap_url=self.server.url))
        assert isinstance(mgr, MooncakePrefillManager)
        self.mgr = mgr
        assert self.mgr.registered.wait(scaled(10)), "prefill rank did not register"
        self.addr = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.mgr.close()
        self.server.stop()


def wait_status(handle, timeout: float, since: float | None = None) -> tuple[KVPoll, float]:
    """Poll until the handle is terminal, at most `timeout` (scaled); its status and the seconds since `since`
    (a `time.monotonic()` taken before what started the clock; default: now)."""
    t0 = time.monotonic() if since is None else since
    deadline = time.monotonic() + scaled(timeout)
    while not handle.poll().terminal and time.monotonic() < deadline:
        time.sleep(0.005)
    status = handle.poll()
    return status, time.monotonic() - t0


def wait_for(handle, status: KVPoll, timeout: float = 10) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while handle.poll() < status and time.monotonic() < deadline:
        time.sleep(0.005)
    assert handle.poll() >= status, f"still {handle.poll().name}: {handle.failure_reason()}"


def counted(read, want: int, what: str) -> int:
    """A metric that the transfer threads update just after the status the test saw: wait until it reaches
    `want`, then return it (the caller asserts it is exactly `want`)."""
    wait_until(lambda: read() >= want, timeout=5, interval=0.01, what=what)
    return read()


@pytest.fixture(scope="module")
def pair():
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL)
    yield prefill, decode
    decode.close()
    prefill.close()


def transfer(pair, src: list[int], dst: list[int], chunks: list[int], skip: int = 0) -> int:
    """One room from prefill's `src` pages, sent in `chunks` as prefill computes them, to decode's `dst` (after the
    `skip` pages decode holds), both sides at Success with the aux record through; the bytes prefill counted."""
    prefill, decode = pair
    room = next(_rooms)
    bytes_before = prefill.mgr.metrics.bytes_total
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, dst, 3, skip)
    wait_for(sender, KVPoll.WaitingForInput)
    offset = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        sender.send(src[offset : offset + n], last=last, aux=pack_first_token(1234, -0.25) if last else None)
        offset += n
    status, _ = wait_status(sender, 30)
    assert status is KVPoll.Success, sender.failure_reason()
    d_status, reason, _, _ = decode.wait(room, 30)
    assert d_status == KVPoll.Success, reason
    assert unpack_first_token(decode("aux", room)) == (1234, -0.25)
    # Every page written, of every buffer (K and V of 2 layers), counted once the room succeeded.
    want = (len(src) - skip) * prefill.pool.page_nbytes * 4
    return counted(lambda: prefill.mgr.metrics.bytes_total - bytes_before, want, "the room's bytes counted")


@pytest.mark.parametrize(
    "src,dst,chunks",
    [
        (list(range(8, 24)), list(range(30, 46)), [16]),  # contiguous: one run per buffer
        ([3, 9, 4, 60, 61, 62, 0], [50, 2, 17, 5, 6, 7, 33], [7]),  # scattered, mixed runs
        (list(range(10, 30)), random.Random(1).sample(range(64), 20), [5, 8, 7]),  # chunked prefill
        (random.Random(2).sample(range(64), 40), random.Random(3).sample(range(64), 40), [40]),  # staged, one send
    ],
)
def test_destination_pages_are_byte_identical(pair, src, dst, chunks):
    prefill, decode = pair
    moved = transfer(pair, src, dst, chunks)
    assert decode("bytes", dst) == prefill.pool.page_bytes(src)
    assert moved == len(src) * prefill.pool.page_nbytes * 4


@pytest.mark.parametrize(
    "skip,chunks,fragmented",
    [
        (5, [5, 8, 7], False),  # exactly the first send: it writes nothing
        (7, [5, 8, 7], False),  # part of the middle send
        (19, [5, 8, 7], False),  # every page but the last token's
        (13, [20], True),  # one send, the rest staged on both sides (fragmented destination)
    ],
)
def test_a_room_whose_start_decode_holds_gets_only_the_rest(pair, skip, chunks, fragmented):
    prefill, decode = pair
    src = list(range(10, 30))
    rng = random.Random(skip)
    dst = rng.sample(range(64), len(src) - skip) if fragmented else list(range(40, 40 + len(src) - skip))
    moved = transfer(pair, src, dst, chunks, skip)  # prefill sends every page of the room
    assert decode("bytes", dst) == prefill.pool.page_bytes(src[skip:])
    assert moved == (len(src) - skip) * prefill.pool.page_nbytes * 4  # the pages decode lacked, nothing more


@pytest.fixture(scope="module")
def streaming(pair):
    """A prefill rank that streams its KV layer by layer (groups of one layer), writing to `pair`'s decode."""
    prefill = Prefill(SMALL, layer_pipeline=True, layer_group_size=1)
    yield prefill, pair[1]
    prefill.close()


def forward(prefill: Prefill, layers: int = 2) -> None:
    """What the model does to an armed stream: each layer computed, then the forward's end."""
    stream = prefill.mgr.layer_stream
    assert stream is not None
    for layer in range(layers):
        stream.layer_done(layer)
    stream.forward_done()


def stream_transfer(pair, src: list[int], dst: list[int], chunks: list[int], skip: int = 0) -> int:
    """`transfer`, as a streaming prefill does it: each chunk's pages armed before its forward and sent layer by
    layer while it runs, then the send after the step (which then writes nothing but the aux record)."""
    prefill, decode = pair
    room = next(_rooms)
    bytes_before = prefill.mgr.metrics.bytes_total
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, dst, 3, skip)
    wait_for(sender, KVPoll.WaitingForInput)
    offset = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        sender.stream(src[offset : offset + n])
        forward(prefill)
        sender.send(src[offset : offset + n], last=last, aux=pack_first_token(1234, -0.25) if last else None)
        offset += n
    status, _ = wait_status(sender, 30)
    assert status is KVPoll.Success, sender.failure_reason()
    d_status, reason, _, _ = decode.wait(room, 30)
    assert d_status == KVPoll.Success, reason
    assert unpack_first_token(decode("aux", room)) == (1234, -0.25)
    want = (len(src) - skip) * prefill.pool.page_nbytes * 4
    return counted(lambda: prefill.mgr.metrics.bytes_total - bytes_before, want, "the room's bytes counted")


@pytest.mark.parametrize(
    "src,dst,chunks,skip",
    [
        (list(range(8, 24)), list(range(30, 46)), [16], 0),  # contiguous
        (list(range(10, 30)), random.Random(1).sample(range(64), 20), [5, 8, 7], 0),  # chunked, scattered
        (random.Random(2).sample(range(64), 40), random.Random(3).sample(range(64), 40), [40], 0),  # staged
        (list(range(10, 30)), list(range(40, 53)), [5, 8, 7], 7),  # decode holds the first 7 pages
    ],
)
def test_streamed_layer_groups_move_the_same_bytes_as_whole_sends(streaming, src, dst, chunks, skip):
    prefill, decode = streaming
    groups = prefill.mgr.metrics.groups_sent
    moved = stream_transfer(streaming, src, dst, chunks, skip)
    assert decode("bytes", dst) == prefill.pool.page_bytes(src[skip:])
    assert moved == (len(src) - skip) * prefill.pool.page_nbytes * 4  # what whole sends move, nothing more
    assert prefill.mgr.metrics.groups_sent > groups  # the pages did leave layer by layer
    assert prefill.mgr.metrics.last_hidden_share is not None


def test_a_room_decode_aborts_between_two_groups_writes_no_later_group(streaming):
    prefill, decode = streaming
    room, src, dst = next(_rooms), list(range(0, 6)), list(range(20, 26))
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, dst, 3, 0)
    wait_for(sender, KVPoll.WaitingForInput)
    state = prefill.mgr.rooms.get(room)
    sent_before = prefill.mgr.metrics.groups_sent
    sender.stream(src)
    prefill.mgr.layer_stream.layer_done(0)  # layer 0's group leaves; layer 1 is still "computing"
    counted(lambda: prefill.mgr.metrics.groups_sent - sent_before, 1, "the first group's writes settled")
    one_group = state.nbytes
    assert one_group == len(src) * prefill.pool.page_nbytes * 2  # K and V of one layer
    decode("abort", room, "client disconnected mid-stream")
    status, _ = wait_status(sender, 5)
    assert status is KVPoll.Failed
    forward(prefill)  # the forward goes on: its later group finds the room failed and queues nothing
    assert state.nbytes == one_group and state.inflight == 0  # nothing of the later group was written
    wait_until(lambda: decode("unsafe", room) is False, timeout=5, interval=0.05, what="decode's pages released")
    assert prefill.mgr.create_sender(room).poll() is KVPoll.Failed


def test_decode_abort_fails_prefill_sender_and_releases_pages(pair):
    prefill, decode = pair
    room = next(_rooms)
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, [1, 2], 0)
    wait_for(sender, KVPoll.WaitingForInput)
    decode("abort", room, "client disconnected")
    status, _ = wait_status(sender, 5)
    assert status is KVPoll.Failed and "client disconnected" in sender.failure_reason()
    wait_until(
        lambda: decode("unsafe", room) is False, timeout=5, interval=0.05, what="prefill confirming it stopped writing"
    )
    late = prefill.mgr.create_sender(room)
    assert late.poll() is KVPoll.Failed, "an aborted room must not be reused"


def test_prefill_abort_fails_decode_receiver(pair):
    prefill, decode = pair
    room = next(_rooms)
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, [5], 1)
    wait_for(sender, KVPoll.WaitingForInput)
    sender.abort("prompt too long")
    status, reason, unsafe, _ = decode.wait(room, 10)
    assert status == KVPoll.Failed and "prompt too long" in reason and unsafe is False


def test_prefill_bootstrap_timeout_when_decode_never_comes():
    timeout = 0.5
    prefill = Prefill(SMALL, bootstrap_timeout_s=timeout)
    try:
        created = time.monotonic()  # before the sender exists: `took` is never shorter than its real age
        sender = prefill.mgr.create_sender(next(_rooms))
        status, took = wait_status(sender, 5, since=created)
        assert status is KVPoll.Failed and "bootstrap timeout" in sender.failure_reason()
        assert timeout <= took < timeout + scaled(1.5), took
        assert counted(lambda: prefill.mgr.metrics.bootstrap_failures, 1, "the bootstrap failure counted") == 1
    finally:
        prefill.close()


def test_incompatible_page_size_fails_rooms_with_both_values():
    prefill = Prefill(SMALL)
    decode = DecodeProc({**SMALL, "page_size": 8, "num_pages": 32})
    try:
        room = next(_rooms)
        decode("recv", room, prefill.addr, [0], 0)
        status, reason, _, took = decode.wait(room, 20)
        assert status == KVPoll.Failed and "prefill page_size=4" in reason and "decode page_size=8" in reason
        assert took < scaled(5), took
    finally:
        decode.close()
        prefill.close()


def test_heartbeat_loss_fails_receiver_within_interval_times_misses():
    # A check waits at most one interval for /health. `misses` is high so that a live but slow bootstrap server
    # (this test process is busy) is not taken for a lost one before the test stops it: the instance is lost once
    # the checks fail `misses` times in a row, the last ones refused after the stop.
    interval, misses = scaled(0.3), 8
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL, heartbeat_interval_s=interval, heartbeat_max_misses=misses, waiting_timeout_s=scaled(60))
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        decode("recv", room, prefill.addr, [0, 1], 0)
        wait_for(sender, KVPoll.WaitingForInput)
        prefill.server.stop()  # the port now refuses connections: the instance counts as gone
        status, reason, unsafe, took = decode.wait(room, 20)
        assert status == KVPoll.Failed and prefill.addr in reason and "connection refused" in reason
        assert took < interval * (misses + 1) + scaled(1.5), took
        assert unsafe is False, "a refused port is taken as a dead instance: pages are released"
    finally:
        decode.close()
        prefill.close()


def test_a_prefill_rank_decode_cannot_reach_fails_its_rooms_at_once():
    # The topology is valid but names a rank address zmq refuses: the error fails the room (it used to leave it
    # waiting, the resolver's error unread); the waiting timeout is far away.
    from dataclasses import replace

    from disagg_worker.disagg.bootstrap_client import register_rank

    prefill = Prefill(SMALL)
    server = BootstrapServer(0, host="127.0.0.1").start()
    register_rank(server.url, replace(prefill.mgr.registration(), rank_ip="bad host!"))
    decode = DecodeProc(SMALL, waiting_timeout_s=scaled(60))
    try:
        room = next(_rooms)
        decode("recv", room, f"127.0.0.1:{server.port}", [0], 0)
        status, reason, unsafe, took = decode.wait(room, 10)
        assert status == KVPoll.Failed and "bad host!" in reason and not unsafe, reason
        assert took < scaled(5), took
    finally:
        decode.close()
        server.stop()
        prefill.close()


def test_decode_waiting_timeout_aborts_prefill():
    timeout = 1.0
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL, waiting_timeout_s=timeout)
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        decode("recv", room, prefill.addr, [0], 0)
        wait_for(sender, KVPoll.WaitingForInput)
        status, reason, _, took = decode.wait(room, 10)
        assert status == KVPoll.Failed and "waiting timeout" in reason and took < timeout + scaled(2), (reason, took)
        assert wait_status(sender, 5)[0] is KVPoll.Failed
    finally:
        decode.close()
        prefill.close()


def test_killing_decode_mid_transfer_fails_sender_within_timeout():
    big = dict(num_layers=2, num_pages=512, page_size=16, num_kv_heads=8, head_dim=128)  # 64 KiB pages
    waiting = 10.0
    prefill = Prefill(big, waiting_timeout_s=waiting)
    decode = DecodeProc(big)
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        dst = list(range(511, -1, -1))  # reversed: no two pages coalesce, 2048 writes
        decode("recv", room, prefill.addr, dst, 0)
        wait_for(sender, KVPoll.WaitingForInput)
        # Decode is frozen before the first write: 128 MiB cannot land in a process that reads nothing, so the
        # transfer is on the wire when decode dies however fast or slow this machine is.
        os.kill(decode.pid, signal.SIGSTOP)
        for start in range(0, 512, 32):
            sender.send(list(range(start, start + 32)), last=start == 480)
        assert sender.poll() is KVPoll.Transferring, "the transfer must be on the wire when decode dies"
        decode.proc.kill()
        status, took = wait_status(sender, 15)
        assert status is KVPoll.Failed, "transfer must not succeed into a dead process"
        # The dead peer's refused writes fail the room (the waiting timeout's reason names no decode).
        assert took < waiting + scaled(1) and "decode" in sender.failure_reason(), (took, sender.failure_reason())
        assert counted(lambda: prefill.mgr.metrics.transfer_failures, 1, "the transfer failure counted") == 1
    finally:
        decode.close()
        prefill.close()


def test_bootstrap_token_is_required_end_to_end():
    prefill = Prefill(SMALL, token="s3cret")  # its bootstrap server and its rank's registration
    good = DecodeProc(SMALL, auth_token="s3cret")
    bad = DecodeProc(SMALL, auth_token="guess")
    try:
        room = next(_rooms)
        bad("recv", room, prefill.addr, [0], 0)
        status, reason, unsafe, took = bad.wait(room, 20)
        assert status == KVPoll.Failed and "401" in reason and unsafe is False and took < scaled(5), (reason, took)
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        good("recv", room, prefill.addr, [0], 0)
        wait_for(sender, KVPoll.WaitingForInput)
        sender.send([9], last=True, aux=pack_first_token(7))
        assert good.wait(room, 20)[0] == KVPoll.Success
        assert good("bytes", [0]) == prefill.pool.page_bytes([9])
    finally:
        bad.close()
        good.close()
        prefill.close()


def test_frozen_decode_times_out_and_pages_stay_quarantined_until_writes_settle():
    big = dict(num_layers=2, num_pages=512, page_size=16, num_kv_heads=8, head_dim=128)
    waiting = 2.0
    prefill = Prefill(big, waiting_timeout_s=waiting)
    decode = DecodeProc(big, waiting_timeout_s=scaled(60))
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        decode("recv", room, prefill.addr, list(range(511, -1, -1)), 0)
        wait_for(sender, KVPoll.WaitingForInput)
        # Frozen before the send: none of the 128 MiB can land before the waiting timeout, on any machine.
        os.kill(decode.pid, signal.SIGSTOP)
        sent = time.monotonic()
        sender.send(list(range(512)), last=True)
        status, took = wait_status(sender, 15, since=sent)
        assert status is KVPoll.Failed and "timed out" in sender.failure_reason(), sender.failure_reason()
        assert waiting <= took < waiting + scaled(2.0), took
        os.kill(decode.pid, signal.SIGCONT)
        d_status, reason, _, _ = decode.wait(room, 20)
        assert d_status == KVPoll.Failed and "timed out" in reason
        settled = "prefill confirming its writes settled"
        wait_until(lambda: decode("unsafe", room) is False, timeout=30, interval=0.1, what=settled)
    finally:
        if decode.proc.is_alive():
            os.kill(decode.pid, signal.SIGCONT)
        decode.close()
        prefill.close()


def test_a_burst_of_writes_beyond_mooncakes_per_peer_queue_all_land():
    """64 rooms sent at once, 64 single-page writes each: 4096 writes to one peer, four times what
    Mooncake TCP queues per peer. Every room succeeds and every page arrives intact."""
    pool = dict(num_layers=2, num_pages=2048, page_size=4, num_kv_heads=2, head_dim=32)
    prefill = Prefill(pool, waiting_timeout_s=scaled(60))
    decode = DecodeProc(pool, waiting_timeout_s=scaled(60))
    try:
        rng = random.Random(5)
        rooms = []
        for i in range(64):
            room = next(_rooms)
            dst = [p for start in range(i * 32, i * 32 + 16, 4) for p in range(start, start + 4)]  # runs of 4
            src = rng.sample(range(2048), 16)  # scattered: every page is its own write in each of 4 buffers
            sender = prefill.mgr.create_sender(room)
            decode("recv", room, prefill.addr, dst, i % 8)
            rooms.append((room, sender, src, dst))
        for _, sender, _, _ in rooms:
            wait_for(sender, KVPoll.WaitingForInput)
        for _, sender, src, _ in rooms:
            sender.send(src, last=True)
        for room, sender, _, _ in rooms:
            status, _ = wait_status(sender, 60)
            assert status is KVPoll.Success, sender.failure_reason()
            d_status, reason, _, _ = decode.wait(room, 30)
            assert d_status == KVPoll.Success, reason
        src_all = [p for *_, src, _ in rooms for p in src]
        dst_all = [p for *_, dst in rooms for p in dst]
        assert decode("bytes", dst_all) == prefill.pool.page_bytes(src_all)
    finally:
        decode.close()
        prefill.close()


# ---- instances of several ranks (TP and PP), one process per rank ---------------------------------
ROOMS = [
    (list(range(8, 24)), list(range(30, 46)), [16]),  # contiguous: one run per buffer
    ([3, 9, 4, 60, 61, 62, 0], [50, 2, 17, 5, 6, 7, 33], [7]),  # scattered, mixed runs
    (list(range(10, 30)), random.Random(1).sample(range(64), 20), [5, 8, 7]),  # chunked prefill
    (random.Random(2).sample(range(64), 40), random.Random(3).sample(range(64), 40), [40]),  # fragmented: staged
]


@pytest.mark.parametrize(
    "prefill,decode,kv_heads",
    [
        ((2, 1), (1, 1), 2),  # decode takes one head from each prefill rank
        ((1, 1), (2, 1), 2),  # each decode rank takes its head from the one prefill rank
        ((2, 1), (1, 1), 1),  # the one KV head is replicated on both prefill ranks: written once
        ((1, 1), (2, 1), 1),  # ... and on both decode ranks: each gets it
        ((1, 2), (1, 1), 2),  # both prefill stages write into one decode rank
        ((1, 2), (1, 2), 2),  # stage to stage
    ],
    ids=["tp2-tp1", "tp1-tp2", "tp2-tp1-replicated", "tp1-tp2-replicated", "pp2-pp1", "pp2-pp2"],
)
def test_ranks_of_both_instances_move_byte_identical_kv(prefill, decode, kv_heads):
    pair = Pair(prefill, decode, Geometry(kv_heads=kv_heads))
    try:
        for slot, (src, dst, chunks) in enumerate(ROOMS):
            room = run_room(pair, src, dst, chunks, slot)
            for d in pair.decode:
                got, want = d("kv", dst), pair.expected(d, src)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), f"decode {d.shard}, room {slot}"
                assert unpack_first_token(d("aux", room)) == (1234, -0.25)
    finally:
        pair.close()


def run_room(pair: Pair, src: list[int], dst: list[int], chunks: list[int], slot: int) -> int:
    """One room through every rank of both instances, to Success on all; returns the room."""
    room = next(_rooms)
    for p in pair.prefill:
        p("sender", room)
    for d in pair.decode:
        d("recv", room, pair.addr, dst, slot)
    for p in pair.prefill:
        status, reason = p.until(room, KVPoll.WaitingForInput, 20)
        assert status == KVPoll.WaitingForInput, reason
    sends, first = [], 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        sends.append((src[first : first + n], last, pack_first_token(1234, -0.25) if last else None))
        first += n
    for p in pair.prefill:
        p("send", room, sends)
    for rank in pair.prefill + pair.decode:
        status, reason, _ = rank.wait(room, 30)
        assert status == KVPoll.Success, f"{rank.role} {rank.shard}: {reason}"
    return room


def moved(pair: Pair, want: int) -> list[int]:
    """Bytes each prefill rank's transfers moved, once their sum reached `want` (counted just after Success)."""
    wait_until(lambda: sum(p("moved") for p in pair.prefill) >= want, timeout=5, interval=0.02, what="bytes counted")
    return [p("moved") for p in pair.prefill]


@pytest.mark.parametrize(
    "prefill,decode",
    [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (2, 1)), ((1, 2), (1, 1))],
    ids=["tp1-tp1", "tp2-tp1", "tp1-tp2", "tp2-tp2", "pp2-pp1"],
)
def test_mla_latent_is_sent_once_per_decode_rank_and_never_twice(prefill, decode):
    """Every rank holds the whole latent: each decode rank gets it from exactly one prefill rank of its group, the
    others send nothing and still succeed; bytes = tokens' pages x layers x page bytes x decode TP ranks."""
    geo = Geometry(kind="mla", kv_heads=1, head_dim=40)
    pair = Pair(prefill, decode, geo)
    try:
        page_nbytes = geo.page_size * geo.head_dim * 4
        total = 0
        for slot, (src, dst, chunks) in enumerate(ROOMS):
            room = run_room(pair, src, dst, chunks, slot)
            for d in pair.decode:
                got, want = d("kv", dst), pair.expected(d, src)
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), f"decode {d.shard}, room {slot}"
                assert unpack_first_token(d("aux", room)) == (1234, -0.25)
            total += len(src) * geo.layers * page_nbytes * decode[0]
            per_rank = moved(pair, total)
            assert sum(per_rank) == total, (per_rank, total)
        if prefill[0] > decode[0]:  # the group's second prefill rank holds nothing its decode rank lacks
            assert per_rank[1] == 0 and per_rank[0] == total, per_rank
    finally:
        pair.close()


@pytest.mark.parametrize("prefill_kind,decode_kind", [("mla", "mha"), ("mha", "mla")])
def test_mla_and_per_head_kv_are_never_paired(prefill_kind, decode_kind):
    pair = Pair((1, 1), (1, 1), Geometry(kind=prefill_kind, kv_heads=1, head_dim=40), kind=decode_kind)
    try:
        room = next(_rooms)
        pair.prefill[0]("sender", room)
        pair.decode[0]("recv", room, pair.addr, [0, 1], 0)
        status, reason, _ = pair.decode[0].wait(room, 20)
        assert status == KVPoll.Failed, reason
        assert f"prefill kv_kind={prefill_kind}" in reason and f"decode kv_kind={decode_kind}" in reason, reason
    finally:
        pair.close()


@pytest.mark.parametrize(
    "prefill,decode,layers,decode_geo,needles",
    [
        ((2, 1), (1, 1), 4, {"page_size": 8, "num_pages": 32}, ["prefill page_size=4", "decode page_size=8"]),
        ((1, 1), (1, 1), 4, {"kv_dtype": "float16"}, ["prefill kv_dtype=float32", "decode kv_dtype=float16"]),
        ((1, 2), (1, 3), 6, {}, ["prefill pp_size=2", "decode pp_size=3", "must be equal or 1"]),
    ],
    ids=["page-size", "kv-dtype", "pp3-vs-pp2"],
)
def test_a_mismatched_pair_fails_its_first_request_with_both_values_within_5s(
    prefill, decode, layers, decode_geo, needles
):
    pair = Pair(prefill, decode, Geometry(layers=layers), **decode_geo)
    try:
        room = next(_rooms)
        for p in pair.prefill:
            p("sender", room)
        for d in pair.decode:
            d("recv", room, pair.addr, [0, 1], 0)
        for d in pair.decode:
            status, reason, took = d.wait(room, 20)
            assert status == KVPoll.Failed and all(n in reason for n in needles), reason
            assert pair.addr in reason and took < scaled(5), (reason, took)
    finally:
        pair.close()
