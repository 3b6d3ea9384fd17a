"""What the scheduler process records of a traced request (`request/trail.py`): each stage prefill and decode
take it through, in order, with its times and attributes, sent back with its outputs; and nothing for a request
that is not traced."""

from __future__ import annotations

import time

import pytest

from disagg_worker.config import Role
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg
from disagg_worker.request.trail import Trail
from tests.timing import scaled
from tests.unit.test_migration import PROMPT, ROOMS, held_by_prefill, pd_config

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tiny_model):
    p, d = (load_engine(pd_config(tiny_model, role)) for role in (Role.PREFILL, Role.DECODE))
    yield p, d
    p.close()
    d.close()


def run_pair(pair: tuple[Engine, Engine], traced: bool) -> tuple[list[msg.TokenOut], list[msg.TokenOut]]:
    """One request through prefill and decode (the fake transfer); the outputs each sent."""
    p, d = pair
    room = msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))
    p.handle(msg.GenerateReq("p", PROMPT, PARAMS, room, traced=traced))
    held_by_prefill(p, "p")  # the fake transfer pairs a receiver only with a sender that exists already
    d.handle(msg.GenerateReq("d", PROMPT, PARAMS, room, traced=traced))
    assert all(e.cfg.overlap is True for e in pair)  # the executor's: launched steps overlap
    steppers = [Stepper(e) for e in pair]
    outs: list[list[msg.TokenOut]] = [[], []]
    deadline = time.monotonic() + scaled(60)
    while any(s.busy for s in steppers):
        assert time.monotonic() < deadline, "the engines did not finish"
        if not any(s.computing for s in steppers):
            time.sleep(0.002)
        for s in steppers:
            s.step()
        for got, e in zip(outs, pair, strict=True):
            got += e.take_outputs()
    for s in steppers:
        s.close()
    return outs[0], outs[1]


def test_a_traced_request_brings_back_each_stage_of_prefill_and_decode(pair):
    start = time.time_ns()
    p_outs, d_outs = run_pair(pair, traced=True)
    p_stages = [s for o in p_outs for s in o.stages]
    d_stages = [s for o in d_outs for s in o.stages]
    chunks = -(-len(PROMPT) // 8)  # chunk size 8
    assert [s.name for s in p_stages] == [
        "prefill.bootstrap",
        "scheduler.waiting",
        *["forward"] * chunks,
        "kv.transfer",
    ]
    assert sum(s.attrs["tokens"] for s in p_stages if s.name == "forward") == len(PROMPT)
    sent = next(s for s in p_stages if s.name == "kv.transfer")
    assert sent.attrs["status"] == "Success" and sent.attrs["pages"] == -(-len(PROMPT) // 4)
    assert sent.attrs["bytes"] > 0
    assert [s.name for s in d_stages] == ["decode.prealloc", "kv.transfer", "first_token", "decoding"]
    received = d_stages[1]
    assert received.attrs["pages"] == sent.attrs["pages"] and received.attrs["bytes"] == sent.attrs["bytes"]
    assert received.attrs["peer"] == "127.0.0.1:1" and received.attrs["status"] == "Success"
    assert d_stages[-1].attrs == {"finish_reason": "length", "output_tokens": PARAMS.max_new_tokens}
    for s in p_stages + d_stages:
        assert start <= s.start_ns <= s.end_ns <= time.time_ns(), s
    # Decode's stages follow one another; its first token is the moment decoding begins.
    for a, b in zip(d_stages, d_stages[1:], strict=False):
        assert a.end_ns <= b.start_ns, (a, b)
    assert d_stages[2].start_ns == d_stages[2].end_ns


def test_a_request_that_is_not_traced_has_no_trail_and_brings_back_no_stages(pair):
    p_outs, d_outs = run_pair(pair, traced=False)
    assert p_outs and d_outs and not any(o.stages for o in p_outs + d_outs)


def test_a_trail_ends_the_oldest_stage_of_a_name_and_sends_each_stage_once():
    t = Trail()
    t.begin("forward", tokens=8)
    t.begin("forward", tokens=4)
    t.end("forward")
    t.end("nothing open")
    (first,) = t.take()
    assert first.attrs == {"tokens": 8} and t.take() == ()
    t.finish(finish_reason="abort")
    (second,) = t.take()
    assert second.attrs == {"tokens": 4, "finish_reason": "abort"}
