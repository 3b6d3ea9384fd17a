"""The KV control channel trusts no one who merely reaches its port: over real zmq sockets, only frames sealed with
the model's key are acted on; a forged, unsealed, oversized or malformed frame is dropped and counted, and so is an
authentic frame captured off the wire and sent again, to its receiver or another."""

from __future__ import annotations

import time

import pytest
import zmq

from disagg_worker import keys
from disagg_worker.disagg.channel import MAX_FRAME_BYTES, REJECTED, ControlChannel, seal
from disagg_worker.disagg.envelope import Stamp, stamp
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
        seal(KEY, b'{"type": "RoomUpdate"'),  # authentic but not stamped
        seal(KEY, stamp(Stamp("tcp://k:1", channel.endpoint, 1, 1), b'{"type": "RoomUpdate"')),  # not a message
        seal(KEY, stamp(Stamp("tcp://k:1", channel.endpoint, 1, 2), encode(REAL))),
    ]
    push(channel.endpoint, frames)
    want = {
        "unauthenticated": before["unauthenticated"] + 3,
        "oversized": before["oversized"] + 1,
        "malformed": before["malformed"] + 2,
    }
    assert recv_all(channel, 1, want) == [REAL]  # only the sealed, well-formed frame is acted on


def capture(sender: ControlChannel, msgs: list) -> tuple[int, list[bytes]]:
    """Frames `sender` sealed for a port, as someone on the path saw them (the port is free again after)."""
    ctx = zmq.Context()
    tap = ctx.socket(zmq.PULL)
    tap.setsockopt(zmq.LINGER, 0)
    port = tap.bind_to_random_port("tcp://127.0.0.1")
    for m in msgs:
        assert sender.send(f"tcp://127.0.0.1:{port}", m)
    frames = []
    while len(frames) < len(msgs):
        assert tap.poll(10_000), "the sender's frames never came"
        frames.append(tap.recv())
    tap.close(0)
    ctx.term()
    return port, frames


def test_an_authentic_frame_sent_again_is_dropped_and_counted_while_fresh_frames_pass(channel):
    sender = ControlChannel("127.0.0.1", key=KEY)
    first, second = RoomAbort(decode_id="d", room=1, reason="one"), RoomAbort(decode_id="d", room=2, reason="two")
    try:
        port, frames = capture(sender, [first, second])
        receiver = ControlChannel("127.0.0.1", port, key=KEY)  # where the captured frames were going
        try:
            before = rejected("replayed")
            push(receiver.endpoint, frames)  # delivered once, as the path would have
            assert recv_all(receiver, 2, {}) == [first, second]
            push(receiver.endpoint, frames[::-1] + frames)
            assert sender.send(receiver.endpoint, REAL)  # a fresh frame still passes, after the replays
            assert recv_all(receiver, 1, {"replayed": before + 4}) == [REAL]
            push(receiver.endpoint, frames[:1])  # a frame captured before a fresh one is still old
            assert recv_all(receiver, 0, {"replayed": before + 5}) == []
        finally:
            receiver.close()
    finally:
        sender.close()


def test_a_frame_replayed_to_another_rank_is_dropped_as_misaddressed(channel):
    sender = ControlChannel("127.0.0.1", key=KEY)
    try:
        _, frames = capture(sender, [REAL])
        before = rejected("misaddressed")
        push(channel.endpoint, frames)  # a rank that has never heard this sender
        assert recv_all(channel, 0, {"misaddressed": before + 1}) == []
    finally:
        sender.close()


def test_a_restarted_sender_is_heard_and_its_previous_lifes_frames_are_not():
    sender = ControlChannel("127.0.0.1", key=KEY)
    sender_port = sender.port
    old = [RoomAbort(decode_id="d", room=i, reason="old life") for i in range(3)]
    try:
        port, frames = capture(sender, old)
    finally:
        sender.close()
    receiver = ControlChannel("127.0.0.1", port, key=KEY)
    try:
        push(receiver.endpoint, frames)
        assert recv_all(receiver, 3, {}) == old
        restarted = ControlChannel("127.0.0.1", sender_port, key=KEY)  # same endpoint, newer epoch, counting anew
        try:
            assert restarted.send(receiver.endpoint, REAL)
            assert recv_all(receiver, 1, {}) == [REAL]  # its first frame, below the old life's last count
            before = rejected("replayed")
            push(receiver.endpoint, frames[-1:])
            assert recv_all(receiver, 0, {"replayed": before + 1}) == []
        finally:
            restarted.close()
    finally:
        receiver.close()
