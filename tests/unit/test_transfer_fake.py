"""The fake backend through the public backend table: what a scheduler unit test relies on."""

from __future__ import annotations

import itertools

import pytest

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg import (
    KVLayout,
    KVPoll,
    create_kv_manager,
    manager_class,
    pack_first_token,
    unpack_first_token,
    unpack_top_logprobs,
)
from disagg_worker.disagg.fake import FakeKVManager
from disagg_worker.request.params import MAX_LOGPROBS

LAYOUT = KVLayout([0x1000, 0x9000], [4096, 4096], page_nbytes=512, page_size=4, kv_dtype="float32", num_pages=8)
_rooms = itertools.count(1 << 40)


def managers():
    p = create_kv_manager(DisaggConfig(role=Role.PREFILL, transfer_backend="fake"), LAYOUT)
    d = create_kv_manager(DisaggConfig(role=Role.DECODE, transfer_backend="fake"), LAYOUT)
    return p, d


def test_backends_are_found_by_name_and_unknown_names_rejected():
    assert manager_class("fake", Role.PREFILL) is FakeKVManager
    with pytest.raises(ValueError, match="unknown transfer backend 'nope'"):
        manager_class("nope", Role.DECODE)
    with pytest.raises(ValueError):
        manager_class("fake", Role.MONOLITHIC)
    with pytest.raises(ValueError, match="unknown transfer backend 'nope'"):
        create_kv_manager(DisaggConfig(role=Role.PREFILL, transfer_backend="nope"), LAYOUT)


def test_fake_round_trip_delivers_aux_and_success():
    p, d = managers()
    room = next(_rooms)
    sender, receiver = p.create_sender(room), d.create_receiver(room, "127.0.0.1:1")
    assert sender.poll() is KVPoll.WaitingForInput and receiver.poll() is KVPoll.WaitingForInput
    receiver.init([0, 1, 2], aux_slot=3)
    sender.send([5, 6], last=False)
    assert sender.poll() is KVPoll.Transferring
    sender.send([7], last=True, aux=pack_first_token(42, -0.5))
    assert sender.poll() is KVPoll.Success and receiver.poll() is KVPoll.Success
    assert unpack_first_token(receiver.aux_bytes()) == (42, -0.5)
    assert p.metrics.transfers == 1 and p.metrics.bytes_total == 3 * 512 * 2


def test_the_aux_record_carries_the_first_tokens_top_logprobs_up_to_the_most_a_request_asks():
    """Decode reports the first token's alternatives as prefill saw them (a P/D answer's top_logprobs
    were shifted by one token without them)."""
    top = [(i, -0.25 * i) for i in range(MAX_LOGPROBS)]
    for logprob, alternatives, want in [(None, None, None), (-0.5, [], []), (-0.5, top[:3], top[:3]), (0.0, top, top)]:
        p, d = managers()
        room = next(_rooms)
        sender, receiver = p.create_sender(room), d.create_receiver(room, "127.0.0.1:1")
        receiver.init([0], aux_slot=1)
        sender.send([4], last=True, aux=pack_first_token(42, logprob, alternatives))
        assert sender.poll() is KVPoll.Success, sender.failure_reason()
        aux = receiver.aux_bytes()
        assert unpack_first_token(aux) == (42, logprob) and unpack_top_logprobs(aux) == want


def test_every_status_move_wakes_the_manager_that_owns_the_handle():
    p, d = managers()
    woken = {"prefill": 0, "decode": 0}
    p.on_change = lambda: woken.__setitem__("prefill", woken["prefill"] + 1)
    d.on_change = lambda: woken.__setitem__("decode", woken["decode"] + 1)
    room = next(_rooms)
    sender, receiver = p.create_sender(room), d.create_receiver(room, "127.0.0.1:1")
    receiver.init([0], aux_slot=0)
    before = dict(woken)
    sender.send([5], last=True)  # prefill's send completes decode's transfer
    assert receiver.poll() is KVPoll.Success
    assert woken["decode"] > before["decode"] and woken["prefill"] > before["prefill"]


def test_decode_abort_fails_prefill_sender_and_vice_versa():
    p, d = managers()
    r1, r2 = next(_rooms), next(_rooms)
    s1, rc1 = p.create_sender(r1), d.create_receiver(r1, "x:1")
    rc1.abort("client went away")
    assert rc1.poll() is KVPoll.Failed and s1.poll() is KVPoll.Failed
    assert "client went away" in s1.failure_reason()
    s2, rc2 = p.create_sender(r2), d.create_receiver(r2, "x:1")
    s2.abort("prompt too long")
    assert rc2.poll() is KVPoll.Failed and "prompt too long" in rc2.failure_reason()
    assert rc2.failure().pages_unsafe is False


def test_reused_room_fails_and_late_calls_do_not_revive_it():
    p, _ = managers()
    room = next(_rooms)
    first = p.create_sender(room)
    first.send([1], last=True)
    again = p.create_sender(room)
    assert again.poll() is KVPoll.Failed and "already used" in again.failure_reason()
    again.send([1], last=True)
    assert again.poll() is KVPoll.Failed and first.poll() is KVPoll.Success


def test_bad_pages_fail_the_room_with_a_reason():
    p, d = managers()
    s = p.create_sender(next(_rooms))
    s.send([8], last=True)
    assert s.poll() is KVPoll.Failed and "out of range" in s.failure_reason()
    r = d.create_receiver(next(_rooms), "x:1")
    r.init([0], aux_slot=LAYOUT.aux_num_slots)
    assert r.poll() is KVPoll.Failed and "aux slot" in r.failure_reason()


def test_wrong_role_is_a_type_error():
    p, d = managers()
    with pytest.raises(TypeError):
        p.create_receiver(1, "x:1")
    with pytest.raises(TypeError):
        d.create_sender(1)


def test_close_fails_live_rooms():
    p, _ = managers()
    s = p.create_sender(next(_rooms))
    p.close()
    assert s.poll() is KVPoll.Failed and "closed" in s.failure_reason()
