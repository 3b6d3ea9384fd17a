"""Real Mooncake TCP between two processes on 127.0.0.1: prefill (this process, with its
bootstrap server) writes KV pages into a decode process's pool."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import time

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

from disagg_worker.config import DisaggConfig, Role  # noqa: E402
from disagg_worker.disagg import KVLayout, KVPoll, RankInfo, create_kv_manager, pack_first_token, unpack_first_token  # noqa: E402
from disagg_worker.disagg.bootstrap import BootstrapServer  # noqa: E402
from disagg_worker.mem.kv_pool import KVPool  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
SMALL = dict(num_layers=2, num_pages=64, page_size=4, num_kv_heads=2, head_dim=32)
_rooms = itertools.count(random.getrandbits(40) << 20)


def _decode_child(conn, pool_kw: dict, cfg_kw: dict, env: dict) -> None:
    """Decode side, driven by (command, *args) tuples over `conn`."""
    os.environ.update(env)
    pool = KVPool(**pool_kw, dtype=torch.float32)
    layout = KVLayout.from_pool(pool, "float32")
    mgr = create_kv_manager(DisaggConfig(role=Role.DECODE, **cfg_kw), layout)
    receivers = {}
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "recv":
            room, addr, dest, slot = args
            receivers[room] = mgr.create_receiver(room, addr)
            receivers[room].init(dest, slot)
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
    def __init__(self, pool_kw: dict, env: dict | None = None, **cfg_kw):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_child, args=(child, pool_kw, cfg_kw, env or {}), daemon=True)
        self.proc.start()
        assert self.conn.poll(60) and self.conn.recv() == "ready"

    def __call__(self, *cmd, timeout: float = 60):
        self.conn.send(cmd)
        assert self.conn.poll(timeout), f"decode process did not answer {cmd[0]}"
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self("stop", timeout=10)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.kill()
        self.proc.join(5)


class Prefill:
    def __init__(self, pool_kw: dict, token: str = "", **cfg_kw):
        self.server = BootstrapServer(0, host="127.0.0.1", token=token).start()
        self.pool = KVPool(**pool_kw, dtype=torch.float32)
        for buf in self.pool.buffers():
            buf.copy_(torch.randn_like(buf))
        cfg = DisaggConfig(role=Role.PREFILL, **cfg_kw)
        self.mgr = create_kv_manager(
            cfg, KVLayout.from_pool(self.pool, "float32"), RankInfo(bootstrap_url=self.server.url)
        )
        assert self.mgr.registered.wait(10), "prefill rank did not register"
        self.addr = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.mgr.close()
        self.server.stop()


def wait_status(handle, timeout: float) -> tuple[KVPoll, float]:
    t0 = time.monotonic()
    while not handle.poll().terminal and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    return handle.poll(), time.monotonic() - t0


def wait_for(handle, status: KVPoll, timeout: float = 10) -> None:
    t0 = time.monotonic()
    while handle.poll() < status and time.monotonic() - t0 < timeout:
        time.sleep(0.005)
    assert handle.poll() >= status, f"still {handle.poll().name}: {handle.failure_reason()}"


@pytest.fixture(scope="module")
def pair():
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL)
    yield prefill, decode
    decode.close()
    prefill.close()


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
    room = next(_rooms)
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, dst, 3)
    wait_for(sender, KVPoll.WaitingForInput)
    offset = 0
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        sender.send(src[offset : offset + n], last=last, aux=pack_first_token(1234, -0.25) if last else None)
        offset += n
    status, _ = wait_status(sender, 30)
    assert status is KVPoll.Success, sender.failure_reason()
    d_status, reason, _, _ = decode("wait", room, 30)
    assert d_status == KVPoll.Success, reason
    assert decode("bytes", dst) == prefill.pool.page_bytes(src)
    assert unpack_first_token(decode("aux", room)) == (1234, -0.25)
    assert prefill.mgr.metrics.bytes_total >= len(src) * prefill.pool.page_nbytes * 4


def test_decode_abort_fails_prefill_sender_and_releases_pages(pair):
    prefill, decode = pair
    room = next(_rooms)
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, [1, 2], 0)
    wait_for(sender, KVPoll.WaitingForInput)
    decode("abort", room, "client disconnected")
    status, _ = wait_status(sender, 5)
    assert status is KVPoll.Failed and "client disconnected" in sender.failure_reason()
    deadline = time.monotonic() + 5
    while decode("unsafe", room) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode("unsafe", room) is False, "prefill never confirmed it stopped writing"
    late = prefill.mgr.create_sender(room)
    assert late.poll() is KVPoll.Failed, "an aborted room must not be reused"


def test_prefill_abort_fails_decode_receiver(pair):
    prefill, decode = pair
    room = next(_rooms)
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, [5], 1)
    wait_for(sender, KVPoll.WaitingForInput)
    sender.abort("prompt too long")
    status, reason, unsafe, _ = decode("wait", room, 10)
    assert status == KVPoll.Failed and "prompt too long" in reason and unsafe is False


def test_prefill_bootstrap_timeout_when_decode_never_comes():
    prefill = Prefill(SMALL, bootstrap_timeout_s=0.5)
    try:
        sender = prefill.mgr.create_sender(next(_rooms))
        status, took = wait_status(sender, 5)
        assert status is KVPoll.Failed and "bootstrap timeout" in sender.failure_reason()
        assert 0.4 < took < 2.0
        assert prefill.mgr.metrics.bootstrap_failures == 1
    finally:
        prefill.close()


def test_incompatible_page_size_fails_rooms_with_both_values():
    prefill = Prefill(SMALL)
    decode = DecodeProc({**SMALL, "page_size": 8, "num_pages": 32})
    try:
        room = next(_rooms)
        decode("recv", room, prefill.addr, [0], 0)
        status, reason, _, took = decode("wait", room, 20)
        assert status == KVPoll.Failed and "prefill page_size=4" in reason and "decode page_size=8" in reason
        assert took < 5
    finally:
        decode.close()
        prefill.close()


def test_heartbeat_loss_fails_receiver_within_interval_times_misses():
    interval, misses = 0.3, 2
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL, heartbeat_interval_s=interval, heartbeat_max_misses=misses, waiting_timeout_s=60)
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        decode("recv", room, prefill.addr, [0, 1], 0)
        wait_for(sender, KVPoll.WaitingForInput)
        prefill.server.stop()  # the port now refuses connections: the instance counts as gone
        status, reason, unsafe, took = decode("wait", room, 20)
        assert status == KVPoll.Failed and prefill.addr in reason and "connection refused" in reason
        assert took < interval * (misses + 1) + 1.5
        assert unsafe is False, "a refused port is taken as a dead instance: pages are released"
    finally:
        decode.close()
        prefill.close()


def test_decode_waiting_timeout_aborts_prefill():
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL, waiting_timeout_s=1.0)
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        decode("recv", room, prefill.addr, [0], 0)
        wait_for(sender, KVPoll.WaitingForInput)
        status, reason, _, took = decode("wait", room, 10)
        assert status == KVPoll.Failed and "waiting timeout" in reason and took < 3
        assert wait_status(sender, 5)[0] is KVPoll.Failed
    finally:
        decode.close()
        prefill.close()


def test_killing_decode_mid_transfer_fails_sender_within_timeout():
    big = dict(num_layers=2, num_pages=512, page_size=16, num_kv_heads=8, head_dim=128)  # 64 KiB pages
    prefill = Prefill(big, waiting_timeout_s=10)
    decode = DecodeProc(big)
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        dst = list(range(511, -1, -1))  # reversed: no two pages coalesce, 2048 writes
        decode("recv", room, prefill.addr, dst, 0)
        wait_for(sender, KVPoll.WaitingForInput)
        for start in range(0, 512, 32):
            sender.send(list(range(start, start + 32)), last=start == 480)
        deadline = time.monotonic() + 10  # wait for the state this test interrupts, then interrupt it
        while sender.poll() < KVPoll.Transferring and time.monotonic() < deadline:
            time.sleep(0.002)
        assert sender.poll() is KVPoll.Transferring, "the transfer must be on the wire when decode dies"
        decode.proc.kill()
        status, took = wait_status(sender, 15)
        assert status is KVPoll.Failed, "transfer must not succeed into a dead process"
        assert took < 10 + 1 and "decode" in sender.failure_reason()
        assert prefill.mgr.metrics.transfer_failures == 1
    finally:
        decode.close()
        prefill.close()


def test_bootstrap_token_is_required_end_to_end(monkeypatch):
    monkeypatch.setenv("DISAGG_AUTH_TOKEN", "s3cret")  # read by the prefill manager at start
    prefill = Prefill(SMALL, token="s3cret")
    good = DecodeProc(SMALL, env={"DISAGG_AUTH_TOKEN": "s3cret"})
    bad = DecodeProc(SMALL, env={"DISAGG_AUTH_TOKEN": "guess"})
    try:
        room = next(_rooms)
        bad("recv", room, prefill.addr, [0], 0)
        status, reason, unsafe, took = bad("wait", room, 20)
        assert status == KVPoll.Failed and "401" in reason and unsafe is False and took < 5
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        good("recv", room, prefill.addr, [0], 0)
        wait_for(sender, KVPoll.WaitingForInput)
        sender.send([9], last=True, aux=pack_first_token(7))
        assert good("wait", room, 20)[0] == KVPoll.Success
        assert good("bytes", [0]) == prefill.pool.page_bytes([9])
    finally:
        bad.close()
        good.close()
        prefill.close()


def test_frozen_decode_times_out_and_pages_stay_quarantined_until_writes_settle():
    import signal

    big = dict(num_layers=2, num_pages=512, page_size=16, num_kv_heads=8, head_dim=128)
    prefill = Prefill(big, waiting_timeout_s=2.0)
    decode = DecodeProc(big, waiting_timeout_s=60)
    try:
        room = next(_rooms)
        sender = prefill.mgr.create_sender(room)
        decode("recv", room, prefill.addr, list(range(511, -1, -1)), 0)
        wait_for(sender, KVPoll.WaitingForInput)
        sender.send(list(range(512)), last=True)
        os.kill(decode.proc.pid, signal.SIGSTOP)
        status, took = wait_status(sender, 15)
        assert status is KVPoll.Failed and "timed out" in sender.failure_reason() and took < 2.0 + 2.0
        os.kill(decode.proc.pid, signal.SIGCONT)
        d_status, reason, _, _ = decode("wait", room, 20)
        assert d_status == KVPoll.Failed and "timed out" in reason
        deadline = time.monotonic() + 30
        while decode("unsafe", room) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert decode("unsafe", room) is False, "prefill must confirm once its writes settled"
    finally:
        if decode.proc.is_alive():
            os.kill(decode.proc.pid, signal.SIGCONT)
        decode.close()
        prefill.close()


def test_a_burst_of_writes_beyond_mooncakes_per_peer_queue_all_land():
    """64 rooms sent at once, 64 single-page writes each: 4096 writes to one peer, four times what
    Mooncake TCP queues per peer. Every room succeeds and every page arrives intact."""
    pool = dict(num_layers=2, num_pages=2048, page_size=4, num_kv_heads=2, head_dim=32)
    prefill = Prefill(pool, waiting_timeout_s=60)
    decode = DecodeProc(pool, waiting_timeout_s=60)
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
            d_status, reason, _, _ = decode("wait", room, 30)
            assert d_status == KVPoll.Success, reason
        src_all = [p for *_, src, _ in rooms for p in src]
        dst_all = [p for *_, dst in rooms for p in dst]
        assert decode("bytes", dst_all) == prefill.pool.page_bytes(src_all)
    finally:
        decode.close()
        prefill.close()
