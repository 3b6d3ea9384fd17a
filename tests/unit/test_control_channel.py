"""The KV control channel trusts no one who merely reaches its port: over real zmq sockets, only frames sealed with
the model's key are acted on; a forged, unsealed, oversized or malformed frame is dropped and counted."""

from __future__ import annotations

import time

import pytest
import zmq

from disagg_worker import keys
from disagg_worker.disagg.channel import MAX_FRAME_BYTES, REJECTED, ControlChannel, seal
from disagg_worker.disagg.messages import DecodeHello, RoomAbort, RoomUpdate, encode

KEY = keys.control_key("the model's secret")
REAL = RoomAbort(decode_id="d", room=7, reason="client left")


def rejected(reason: str) -> float:
    return REJECTED.labels(reason)._value.get()


@pytest.fixture()
def channel():
    c = ControlChannel("127.0.0.1", key=KEY)
    yield c
    c.close()


def push(endpoint: str, frames: list[bytes]) -> None:
    """A third party that reached the port: raw zmq frames."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    for f in frames:
        sock.send(f)
    sock.close()
    ctx.term()


def recv_all(channel: ControlChannel, want: int, reasons: dict[str, float]) -> list:
    """Messages received until `want` arrived and every counter in `reasons` reached its value."""
    got: list = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got += channel.recv(timeout_ms=50)
        if len(got) >= want and all(rejected(r) >= n for r, n in reasons.items()):
            return got
    pytest.fail(f"received {got}; counters {[(r, rejected(r)) for r in reasons]}")


def test_a_peer_with_the_model_key_is_heard(channel):
    sender = ControlChannel("127.0.0.1", key=KEY)
    try:
        assert sender.send(channel.endpoint, REAL)
        assert recv_all(channel, 1, {}) == [REAL]
    finally:
        sender.close()


def test_forged_unsealed_oversized_and_malformed_frames_are_dropped_and_counted(channel):
    before = {r: rejected(r) for r in ("unauthenticated", "oversized", "malformed")}
    forged_hello = DecodeHello(
        decode_id="evil",
        reply_endpoint="tcp://127.0.0.1:1",
        session_id="s",
        buffer_ptrs=[1],
        buffer_nbytes=[1],
        page_nbytes=1,
        start_layer=0,
        aux_item_nbytes=1,
    )
    forged_update = RoomUpdate(room=7, tp_rank=0, pp_rank=0, status=4, reason="", quiesced=True, aux=b"x")
    frames = [
        seal(keys.control_key("a guess"), encode(forged_hello)),
        seal(keys.control_key(""), encode(forged_update)),  # the key of an instance without a secret
        encode(forged_update),  # no MAC at all
        b"x" * (MAX_FRAME_BYTES + 64),
        seal(KEY, b'{"type": "RoomUpdate"'),  # authentic but not a message
        seal(KEY, encode(REAL)),
    ]
    push(channel.endpoint, frames)
    want = {
        "unauthenticated": before["unauthenticated"] + 3,
        "oversized": before["oversized"] + 1,
        "malformed": before["malformed"] + 1,
    }
    assert recv_all(channel, 1, want) == [REAL]  # only the sealed, well-formed frame is acted on
