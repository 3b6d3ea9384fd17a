"""Decode's prefix cache and local prefill in one process (a scripted transfer backend, the tiny model): a
request marked local_prefill is computed by decode itself; a later request whose start decode holds asks prefill
only for the pages after it; when that transfer fails, only those pages are quarantined and the held prefix is
given back to the cache. Without the options, decode refuses local_prefill."""

from __future__ import annotations

import pytest

from disagg_worker.config import ConfigError, DisaggConfig, Role
from disagg_worker.disagg import KVPoll
from disagg_worker.instance.loop import Stepper
from disagg_worker.keys import LOCAL_PREFILL, TARGET, derive, sign_target
from disagg_worker.request import messages as msg
from disagg_worker.request.params import SamplingParams
from tests.unit.test_decode_quarantine import ROOMS, decode_engine

PAGE = 4  # decode_engine's page size
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def run_until_done(stepper: Stepper, rid: str) -> list[msg.TokenOut]:
    outs: list[msg.TokenOut] = []
    for _ in range(200):
        stepper.step()
        outs += stepper.engine.take_outputs()
        if any(o.rid == rid and o.finish_reason is not None for o in outs):
            return outs
    raise AssertionError(f"{rid} never finished: {outs}")


def test_a_held_prefix_is_not_transferred_again_and_a_failed_transfer_gives_it_back(tiny_model):
    engine, kv = decode_engine(tiny_model, decode_prefix_cache=True, local_prefill=True)
    total = engine.allocator.num_total
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    try:
        prompt = list(range(10, 30))  # 20 tokens
        engine.handle(msg.GenerateReq("local", prompt, PARAMS, local_prefill=True))
        outs = run_until_done(stepper, "local")
        tokens = [t for o in outs for t in o.token_ids]
        assert len(tokens) == 4 and not kv.receivers and not any(o.error for o in outs)
        history = prompt + tokens  # 24 tokens; decode computed 23 of them: 5 whole pages cached
        assert engine.radix.total_pages == 5

        follow_up = history + list(range(40, 46))  # 30 tokens, 8 pages: 5 held, 3 from prefill
        engine.handle(msg.GenerateReq("pd", follow_up, PARAMS, msg.BootstrapInfo("10.0.0.7", 8998, next(ROOMS))))
        stepper.step()
        (receiver,) = kv.receivers
        assert receiver.skip_pages == 5 and len(receiver.pages) == 3
        assert engine.radix.total_refs() > 0  # the held pages are locked while the room lives
        receiver.status, receiver.unsafe = KVPoll.Failed, True
        for _ in range(5):
            stepper.step()
        assert [o.error_status for o in engine.take_outputs()] == [500]
        assert engine.allocator.num_free + engine.radix.total_pages == total - 3  # only the 3 written pages held back
        assert engine.radix.total_refs() == 0
        receiver.unsafe = False
        stepper.step()
        assert engine.allocator.num_free + engine.radix.total_pages == total
    finally:
        engine.executor.close()  # its forward thread
        engine.close()


def test_the_last_page_always_comes_from_prefill(tiny_model):
    engine, kv = decode_engine(tiny_model, decode_prefix_cache=True, local_prefill=True)
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    try:
        prompt = list(range(10, 34))  # 24 tokens
        engine.handle(msg.GenerateReq("local", prompt, PARAMS, local_prefill=True))
        run_until_done(stepper, "local")
        # The same prompt again: decode holds all 6 of its pages, but the one of the last token is sent.
        engine.handle(msg.GenerateReq("pd", prompt, PARAMS, msg.BootstrapInfo("10.0.0.7", 8998, next(ROOMS))))
        stepper.step()
        (receiver,) = kv.receivers
        assert receiver.skip_pages == 5 and len(receiver.pages) == 1
    finally:
        engine.executor.close()  # its forward thread
        engine.close()


def test_decode_without_local_prefill_refuses_it(tiny_model):
    engine, kv = decode_engine(tiny_model)
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    try:
        engine.handle(msg.GenerateReq("x", [1, 2, 3], PARAMS, local_prefill=True))
        stepper.step()
        (out,) = engine.take_outputs()
        assert out.error_status == 400 and "does not compute prompts for local_prefill" in out.error
    finally:
        engine.executor.close()  # its forward thread
        engine.close()


def test_with_the_models_secret_only_the_routers_local_prefill_is_taken(tiny_model):
    engine, _ = decode_engine(tiny_model, secret="s3cret", local_prefill=True)
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    key = derive("s3cret", TARGET)
    try:
        engine.handle(msg.GenerateReq("forged", [1, 2, 3], PARAMS, local_prefill=True, local_sig="00" * 32))
        engine.handle(msg.GenerateReq("unsigned", [1, 2, 3], PARAMS, local_prefill=True))
        signed = sign_target(key, LOCAL_PREFILL, 0, 0)
        engine.handle(msg.GenerateReq("router", [1, 2, 3], PARAMS, local_prefill=True, local_sig=signed))
        outs = run_until_done(stepper, "router")
        refused = {o.rid: o.error_status for o in outs if o.error}
        assert refused == {"forged": 403, "unsigned": 403}
        assert len([t for o in outs if o.rid == "router" for t in o.token_ids]) == 4
    finally:
        engine.executor.close()  # its forward thread
        engine.close()


@pytest.mark.parametrize("option", ["decode_prefix_cache", "local_prefill"])
def test_the_decode_options_are_refused_on_prefill(option):
    with pytest.raises(ConfigError, match="decode instance's option"):
        DisaggConfig(role=Role.PREFILL, **{option: True}).check()


def test_requests_in_transfer_hold_running_slots_that_local_prefills_do_not_take(tiny_model):
    engine, kv = decode_engine(tiny_model, local_prefill=True)  # at most 4 running
    assert engine.cfg.overlap is False  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    try:
        for i in range(3):
            info = msg.BootstrapInfo("10.0.0.7", 8998, next(ROOMS))
            engine.handle(msg.GenerateReq(f"pd{i}", list(range(10, 30)), PARAMS, info))
        stepper.step()
        assert [r.status for r in kv.receivers] == [KVPoll.Transferring] * 3  # their KV is on its way
        for i in range(3):
            engine.handle(msg.GenerateReq(f"local{i}", list(range(50, 60)), PARAMS, local_prefill=True))
        stepper.step()
        assert engine.scheduler.num_running == 1 and len(engine.scheduler.waiting) == 2  # 3 slots held
        for r in kv.receivers:
            r.status = KVPoll.Failed
        outs = run_until_done(stepper, "local2")
        assert sorted(o.rid for o in outs if o.error_status == 500) == ["pd0", "pd1", "pd2"]
        assert {o.rid for o in outs if o.finish_reason and not o.error} == {"local0", "local1", "local2"}
    finally:
        engine.executor.close()  # its forward thread
        engine.close()
