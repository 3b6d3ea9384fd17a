"""A control frame's stamp (who sent it, to whom, in which life and as which frame) survives the wire as it was, a
body that is not stamped is refused, and a receiver acts on each sender's frames only while they get newer."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg_worker.disagg.envelope import MAX_ENDPOINT_BYTES, Freshness, Stamp, stamp, unstamp
from disagg_worker.disagg.messages import CodecError

U64 = st.integers(min_value=0, max_value=2**64 - 1)
ENDPOINT = st.text(max_size=40)


@given(ENDPOINT, ENDPOINT, U64, U64, st.binary(max_size=200))
def test_a_stamp_and_its_message_come_back_as_they_were(sender, dest, epoch, counter, payload):
    s = Stamp(sender, dest, epoch, counter)
    assert unstamp(stamp(s, payload)) == (s, payload)


@given(st.binary(max_size=64))
def test_any_body_unstamps_or_is_refused_as_malformed(body):
    try:
        s, payload = unstamp(body)
    except CodecError:
        return
    assert stamp(s, payload) == body


def test_bodies_that_are_not_stamped_are_refused():
    good = stamp(Stamp("tcp://10.0.0.1:5000", "tcp://10.0.0.2:5001", 1, 2), b"{}")
    too_long = struct.pack(">QQHH", 1, 1, MAX_ENDPOINT_BYTES + 1, 0) + b"x" * (MAX_ENDPOINT_BYTES + 1)
    not_utf8 = good.replace(b"10.0.0.2", b"\xff\xfe.0.0.2")
    for body in (b"", b'{"type":"RoomAbort"}', good[:20], good[:-3], too_long, not_utf8):
        with pytest.raises(CodecError):
            unstamp(body)
    with pytest.raises(ValueError):
        stamp(Stamp("x" * (MAX_ENDPOINT_BYTES + 1), "d", 1, 1), b"")


def at(sender: str, epoch: int, counter: int) -> Stamp:
    return Stamp(sender, "tcp://me:1", epoch, counter)


def test_only_newer_frames_of_a_sender_are_admitted_and_a_newer_epoch_starts_afresh():
    heard = Freshness()
    assert heard.admit(at("a", 100, 5))
    assert not heard.admit(at("a", 100, 5))  # the same frame again
    assert not heard.admit(at("a", 100, 3))  # an older one
    assert heard.admit(at("a", 100, 9))  # gaps are fine (frames to other peers, a forgotten socket)
    assert heard.admit(at("b", 100, 1))  # each sender counts on its own
    assert heard.admit(at("a", 200, 1))  # restarted: counting from 1 again
    assert not heard.admit(at("a", 100, 10))  # its previous life is over
    assert not heard.admit(at("a", 200, 1))


def test_the_table_stays_bounded_and_forgets_the_sender_heard_least_recently():
    heard = Freshness(max_senders=3)
    for sender in ("a", "b", "c"):
        assert heard.admit(at(sender, 1, 1))
    assert heard.admit(at("a", 1, 2))  # a is heard again: b is now the oldest
    for i in range(100):
        assert heard.admit(at(f"invented-{i}", 1, 1))
    assert len(heard) == 3
    assert heard.admit(at("invented-0", 1, 1))  # forgotten, so taken again
    heard = Freshness(max_senders=3)
    for sender in ("a", "b", "c"):
        heard.admit(at(sender, 1, 1))
    heard.admit(at("a", 1, 2))
    heard.admit(at("d", 1, 1))
    assert not heard.admit(at("a", 1, 2)) and not heard.admit(at("c", 1, 1))  # still remembered
    assert heard.admit(at("b", 1, 1))  # b was the one forgotten
