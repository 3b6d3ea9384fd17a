"""Decode peers coming and going, over real Mooncake TCP: prefill releases what it holds for a decode that is
gone, tells a restarted decode at the same address from the old one, and a live peer it forgot is greeted
again before its next request."""

from __future__ import annotations

import threading
import time

import pytest

from disagg_worker.disagg import KVPoll, pack_first_token
from disagg_worker.disagg.mooncake import prefill as prefill_module
from tests.integration.procs import free_port, scaled
from tests.integration.test_mooncake_transfer import (
    SMALL,
    DecodeProc,
    Prefill,
    _rooms,
    wait_for,
    wait_status,
    with_transfer_tuning,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(scaled(180))]
# A live peer's next message may come late on a loaded machine: the idle time prefill forgets it after scales.
IDLE_S = scaled(1.0)


@pytest.fixture
def forgetful(monkeypatch):
    """This process's prefill managers forget a peer after IDLE_S of silence (instead of a minute)."""
    monkeypatch.setattr(prefill_module, "TUNING", prefill_module.TUNING)
    with_transfer_tuning(prefill_module, peer_idle_s=IDLE_S, peer_check_interval_s=0.1)


def transfer(prefill: Prefill, decode: DecodeProc, src: list[int], dst: list[int]) -> None:
    room = next(_rooms)
    sender = prefill.mgr.create_sender(room)
    decode("recv", room, prefill.addr, dst, 0)  # the helpers here scale their own deadlines
    wait_for(sender, KVPoll.WaitingForInput)
    sender.send(src, last=True, aux=pack_first_token(7))
    status, _ = wait_status(sender, 30)
    assert status is KVPoll.Success, sender.failure_reason()
    assert decode.wait(room, 30)[0] == KVPoll.Success
    assert decode("bytes", dst) == prefill.pool.page_bytes(src)


def transfer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-transfer-")]


def wait_released(prefill: Prefill, timeout: float) -> float:
    """The time (monotonic) at which prefill was seen holding nothing for any decode peer (no peer, transfer
    thread or control socket)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        mgr = prefill.mgr
        if mgr.known_peers == 0 and not mgr.writes.sessions and mgr.channel.peers == 0 and not transfer_threads():
            return time.monotonic()
        time.sleep(0.05)
    mgr = prefill.mgr
    raise AssertionError(f"still held: {mgr.known_peers} peers, {mgr.writes.sessions}, {mgr.channel.peers} sockets")


def test_prefill_releases_the_thread_and_socket_of_a_decode_that_is_gone(forgetful):
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL)
    try:
        # Prefill last heard from the peer during the transfer (its room request), so not before `asked`: what
        # it holds for the peer is released IDLE_S after that at the earliest, however slow the machine.
        asked = time.monotonic()
        transfer(prefill, decode, [1, 2, 3], [10, 11, 12])
        assert prefill.mgr.known_peers == 1 and len(transfer_threads()) == 1 and prefill.mgr.channel.peers == 1
        decode.proc.kill()
        released = wait_released(prefill, timeout=IDLE_S + scaled(5))
        took = released - asked
        assert took >= IDLE_S, f"released {took:.2f} s after the peer's last request, before the idle time"
    finally:
        decode.close()
        prefill.close()


def test_a_forgotten_live_decode_greets_again_and_its_next_request_succeeds(forgetful):
    prefill = Prefill(SMALL)
    decode = DecodeProc(SMALL, tuning={"hello_refresh_s": IDLE_S / 4})
    try:
        transfer(prefill, decode, [4, 5], [20, 21])
        wait_released(prefill, timeout=IDLE_S + scaled(5))
        transfer(prefill, decode, [6, 7], [22, 23])
        assert prefill.mgr.known_peers == 1
    finally:
        decode.close()
        prefill.close()


def test_a_decode_restarted_at_the_same_address_is_told_from_the_old_one():
    """The old incarnation's rooms fail as soon as the new one says hello (not at their timeouts), and the
    new one is served."""
    # Timeouts twice the bound below on any machine: a room they fail cannot pass for one failed at the hello.
    prefill = Prefill(SMALL, bootstrap_timeout_s=scaled(60), waiting_timeout_s=scaled(60))
    port = free_port()
    old = DecodeProc(SMALL, control_port=port)
    new = None
    try:
        room = next(_rooms)
        waiting = prefill.mgr.create_sender(room)
        old("recv", room, prefill.addr, [1], 0)
        wait_for(waiting, KVPoll.WaitingForInput)
        old.proc.kill()
        old.proc.join(scaled(10))
        assert not old.proc.is_alive(), "the old decode did not exit"
        new = DecodeProc(SMALL, control_port=port)  # the same control endpoint
        t0 = time.monotonic()
        transfer(prefill, new, [8, 9], [30, 31])
        status, _ = wait_status(waiting, 10)
        assert status is KVPoll.Failed and "decode restarted" in waiting.failure_reason()
        assert time.monotonic() - t0 < scaled(30), "the old room must fail at the hello, not at its 60 s timeout"
        assert prefill.mgr.known_peers == 1
    finally:
        old.close()
        if new is not None:
            new.close()
        prefill.close()
