"""What a prefill rank keeps for its decode peers: a restarted decode at the same address replaces the old
incarnation, silent peers with nothing in flight are forgotten, and a retired transfer thread finishes the
jobs it holds before it exits."""

from __future__ import annotations

import threading

from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.messages import DecodeHello
from disagg_worker.disagg.mooncake.peer_book import PeerBook
from disagg_worker.disagg.mooncake.transfer_workers import Progress, TransferWorkers
from tests.timing import wait_until

LAYOUT = KVLayout([0x1000, 0x9000], [4096, 4096], page_nbytes=512, page_size=4, kv_dtype="float32", num_pages=8)


def hello(decode_id: str, endpoint: str, session: str) -> DecodeHello:
    return DecodeHello(
        decode_id=decode_id,
        reply_endpoint=endpoint,
        session_id=session,
        buffer_ptrs=[0x100, 0x200],
        buffer_nbytes=[4096, 4096],
        page_nbytes=512,
        start_layer=0,
        aux_item_nbytes=16,
    )


def test_a_new_incarnation_at_an_old_endpoint_or_session_replaces_the_old_one():
    book = PeerBook()
    assert book.hello(hello("a", "tcp://d1:9000", "d1:15001"), LAYOUT, 0.0) == []
    assert book.hello(hello("b", "tcp://d2:9000", "d2:15001"), LAYOUT, 0.0) == []
    assert book.hello(hello("a", "tcp://d1:9000", "d1:15001"), LAYOUT, 1.0) == [], "a repeated hello is no restart"
    replaced = book.hello(hello("a2", "tcp://d1:9000", "d1:15003"), LAYOUT, 2.0)  # same control endpoint
    assert [k.decode_id for k in replaced] == ["a"] and book.get("a") is None and book.get("a2") is not None
    replaced = book.hello(hello("b2", "tcp://d2:9001", "d2:15001"), LAYOUT, 2.0)  # same transfer session
    assert [k.decode_id for k in replaced] == ["b"] and len(book) == 2
    assert book.uses(endpoint="tcp://d1:9000") and not book.uses(endpoint="tcp://d2:9000")


def test_only_silent_peers_with_nothing_in_flight_are_forgotten():
    book = PeerBook()
    book.hello(hello("a", "tcp://d1:9000", "d1:15001"), LAYOUT, 0.0)
    book.hello(hello("b", "tcp://d2:9000", "d2:15001"), LAYOUT, 0.0)
    book.hello(hello("c", "tcp://d3:9000", "d3:15001"), LAYOUT, 0.0)
    book.seen("c", 9.0)
    assert book.idle(10.0, 5.0, busy={"b"}) and len(book) == 2  # a: silent and idle
    assert {k.decode_id for k in book.known()} == {"b", "c"}
    assert [k.decode_id for k in book.idle(20.0, 5.0, busy=set())] == ["b", "c"] and len(book) == 0


def test_a_retired_transfer_thread_settles_what_it_holds_then_exits_and_a_new_job_starts_a_new_one():
    started: list[str] = []
    release = threading.Event()

    def progress(job: str) -> Progress:
        return Progress.SETTLED if release.is_set() else Progress.WAITING

    workers: TransferWorkers[str] = TransferWorkers(started.append, progress)
    try:
        workers.put("peer", "j1")
        workers.put("peer", "j2")
        workers.retire("peer")
        wait_until(lambda: started == ["j1", "j2"], timeout=5, interval=0.01, what="both jobs started")
        assert workers.busy("peer") and workers.destinations == ["peer"]
        release.set()
        wait_until(lambda: not workers.destinations, timeout=5, interval=0.01, what="the retired thread gone")
        assert not workers.busy("peer")
        assert not [t for t in threading.enumerate() if t.name == "kv-transfer-peer"]
        workers.put("peer", "j3")
        assert workers.destinations == ["peer"]
    finally:
        release.set()
        workers.close()
