"""A request that ends while a step in flight computes for it keeps its pages until that step is processed:
only then may a KV transfer or a load from host memory take them (`engine/in_flight.py`). With overlap the
step after a request's last token is already scheduled when that token is known, and it writes the KV of
one more token into the request's last page."""

from __future__ import annotations

from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.request import messages as msg
from tests.unit.test_engine import make_engine

LONG = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)


def decoding(engine, rid: str, prompt: list[int]):
    """`rid` admitted and past its prefill, the way the loop runs prompt chunks (inline)."""
    engine.handle(msg.GenerateReq(rid, prompt, LONG))
    while not any(r.rid == rid and r.num_generated for r in engine.scheduler.running):
        batch = engine.schedule()
        engine.process(batch, engine.run(batch))


def test_pages_of_a_request_ended_under_a_step_in_flight_are_taken_only_after_that_step(tiny_model):
    engine = make_engine(tiny_model, page_size=4, tokens=64, cache=False)
    try:
        s = engine.scheduler
        decoding(engine, "a", list(range(1, 11)))
        in_flight = engine.schedule()  # the decode step after "a"'s first token, launched (overlap)
        written = s.in_flight.written()
        assert written and written <= set(next(r for r in s.running if r.rid == "a").pages)
        engine.handle(msg.AbortReq("a"))  # ends while that step computes for it (a stop, an EOS, a client gone)
        assert s.running == [] and all(not s.allocator.is_free(p) for p in written)
        taken = s.take_pages(s.allocator.num_free)  # what decode's next transfer (or a host load) could take
        assert taken is not None and written.isdisjoint(taken)
        s.allocator.free(taken)
        engine.process(in_flight, engine.run(in_flight))
        assert s.allocator.num_used == 0 and s.in_flight.held == [] and s.in_flight.batches == []
        assert engine.stats().pages_taken_in_flight == 0
    finally:
        engine.close()


def test_taking_a_page_a_step_in_flight_writes_is_counted(tiny_model):
    """The rule's check where pages leave the allocator: what a test reads if the rule is ever broken."""
    engine = make_engine(tiny_model, page_size=4, tokens=64, cache=False)
    try:
        s = engine.scheduler
        decoding(engine, "a", list(range(1, 11)))
        in_flight = engine.schedule()
        a = next(r for r in s.running if r.rid == "a")
        s.running.remove(a)
        s.pages.give_back(a)  # the release the rule forbids: at once, under the step in flight
        assert s.take_pages(s.allocator.num_free) is not None
        assert engine.stats().pages_taken_in_flight == 1
        engine.process(in_flight, engine.run(in_flight))
    finally:
        engine.close()
