"""A migrated request goes on where it stopped: the engine given the tokens a request generated elsewhere
(`GenerateReq.resumed`) samples next what the uninterrupted request would have sampled, greedy, seeded and under
a grammar, on one instance and through a prefill/decode hand-off; what the router keeps of a stream; and whose a
stalled stream is (its decode's, held out of rotation, or its own) and how often it migrates."""

from __future__ import annotations

import itertools
import json
import time

import pytest

from disagg_worker.config import CacheConfig, DisaggConfig, EngineConfig, Role, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg
from disagg_worker.router.migrate import Progress, failure_of
from disagg_worker.router.policies import Policy
from disagg_worker.router.stall import Verdict, judge, may_migrate, verdict
from disagg_worker.router.verify import PairVerifier
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool
from tests.timing import scaled
from tests.unit.test_engine import assert_idle_accounting, make_engine

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}
KINDS = {
    "greedy": SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    # The frequency and presence penalties count the resumed tokens as the output they are.
    "penalised": SamplingParams(
        max_new_tokens=24, temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True
    ),
    "schema": SamplingParams(
        max_new_tokens=64, temperature=1.0, seed=7, grammar=json.dumps({"type": "json_schema", "schema": SCHEMA})
    ),
}
PROMPT = list(range(30, 61))
ROOMS = itertools.count(1)


def step_until_done(engines: list[Engine], rid: str) -> list[int]:
    """Step `engines` until they are idle; the tokens `rid` got."""
    assert all(e.cfg.overlap is True for e in engines)  # the executor's: launched steps overlap
    steppers = [Stepper(e) for e in engines]
    got: list[int] = []
    deadline = time.monotonic() + scaled(60)
    while any(s.busy for s in steppers):
        assert time.monotonic() < deadline, "the engines did not finish"
        if not any(s.computing for s in steppers):
            time.sleep(0.002)  # a grammar compiling, a transfer moving: nothing to step yet
        for s in steppers:
            s.step()
        for e in engines:
            got += [t for o in e.take_outputs() if o.rid == rid and not o.error for t in o.token_ids]
    for s in steppers:
        s.close()
    return got


def resumed(params: SamplingParams, tokens: list[int], k: int) -> tuple[list[int], SamplingParams]:
    """The prompt and parameters of a request migrated after its first `k` tokens, as the HTTP side makes them."""
    return PROMPT + tokens[:k], SamplingParams(**{**params.__dict__, "max_new_tokens": params.max_new_tokens - k})


@pytest.fixture(scope="module")
def mono(tiny_model):
    return make_engine(tiny_model)


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_resumed_on_one_instance_goes_on_as_if_never_interrupted(mono, kind):
    params = KINDS[kind]
    mono.handle(msg.GenerateReq("whole", PROMPT, params))
    whole = step_until_done([mono], "whole")
    k = 5
    assert len(whole) > k + 3, whole
    ids, rest = resumed(params, whole, k)
    mono.handle(msg.GenerateReq("rest", ids, rest, resumed=k))
    assert step_until_done([mono], "rest") == whole[k:]
    assert_idle_accounting(mono)
    if kind == "schema":
        assert whole[-1] in mono.eos_ids  # the grammar ended the JSON on both runs


def pd_config(model: str, role: Role) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=4, max_total_tokens=2048),
        scheduler=SchedulerConfig(chunk_size=8, max_running_requests=8),
        disagg=DisaggConfig(role=role, transfer_backend="fake"),
    )


@pytest.fixture(scope="module")
def pd(tiny_model):
    p, d = (load_engine(pd_config(tiny_model, role)) for role in (Role.PREFILL, Role.DECODE))
    yield p, d
    p.close()
    d.close()


def held_by_prefill(p: Engine, rid: str) -> None:
    """Step `p` until `rid` is in its stage (a request with a grammar waits for its compilation first)."""
    assert p.cfg.overlap is True  # the executor's: launched steps overlap
    stepper = Stepper(p)
    deadline = time.monotonic() + scaled(60)
    while not any(rid in getattr(p.stage, q) for q in ("bootstrapping", "prefilling", "inflight")):
        assert time.monotonic() < deadline, "prefill never took the request"
        stepper.step()
        time.sleep(0.002)
    stepper.close()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_samples_the_token_after_the_resumed_ones(mono, pd, kind):
    """Prefill samples the next token after the resumed ones (the seed's draws and the grammar moved past them),
    and decode hands it on first. (The fake transfer moves no KV bytes: the tokens decode computes after it are
    checked through a real transfer in tests/integration/test_migration.py.)"""
    params = KINDS[kind]
    mono.handle(msg.GenerateReq("whole", PROMPT, params))
    whole = step_until_done([mono], "whole")
    p, d = pd
    k = 7
    ids, rest = resumed(params, whole, k)
    room = msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))
    p.handle(msg.GenerateReq("p", ids, rest, room, resumed=k))
    held_by_prefill(p, "p")  # the fake transfer pairs a receiver only with a sender that exists already
    d.handle(msg.GenerateReq("d", ids, rest, room, resumed=k))
    got = step_until_done([p, d], "d")
    assert got[0] == whole[k]
    assert len(got) == len(whole) - k or kind == "schema"  # max_tokens counts the resumed tokens


def test_the_router_keeps_a_streams_token_ids_text_and_end():
    progress = Progress()
    progress.note({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hé"}, "token_ids": [5, 6]}]})
    progress.note({"choices": [{"index": 0, "text": "llo", "token_ids": [7]}]})
    assert (progress.token_ids, progress.chars, progress.finished) == ([5, 6, 7], 5, False)
    progress.note({"choices": [{"index": 0, "delta": {}, "token_ids": [], "finish_reason": "length"}]})
    assert progress.finished


def test_only_an_error_the_request_did_not_cause_migrates_a_stream():
    def event(type_: str, code: str | None) -> dict:
        return {"error": {"message": "m", "type": type_, "param": None, "code": code}}

    assert failure_of(event("server_error", "service_unavailable")) is not None  # a decode that drained too long
    assert failure_of(event("server_error", None)) is not None
    assert failure_of(event("server_error", "internal_error")) is None  # the request's own failure
    assert failure_of(event("server_error", "instance_failed")) is None  # it may be what took the decode down
    assert failure_of(event("invalid_request_error", None)) is None
    assert failure_of({"choices": [{"index": 0, "delta": {"content": "x"}}]}) is None


def test_a_stall_is_the_decodes_when_none_of_its_streams_delivered_for_half_the_timeout():
    # The stalled stream's own window opens with its siblings' last events (they stop a step or two apart).
    assert verdict(last_event=100.0, now=160.0, stall_s=60.0) is Verdict.DECODE
    assert verdict(last_event=129.0, now=160.0, stall_s=60.0) is Verdict.DECODE
    assert verdict(last_event=159.9, now=160.0, stall_s=60.0) is Verdict.REQUEST  # its other streams went on
    assert verdict(last_event=0.0, now=160.0, stall_s=60.0) is Verdict.DECODE  # it never delivered


def test_a_stalled_decode_is_held_out_and_a_slow_request_leaves_its_decode_in_rotation():
    d = Worker("http://d", "decode", healthy=True, last_event=100.0)
    assert judge(d, now=100.5, stall_s=2.0, hold_s=30.0) is Verdict.REQUEST
    assert d.available(100.5) and "held_out_s" not in d.describe(100.5)
    assert judge(d, now=102.0, stall_s=2.0, hold_s=30.0) is Verdict.DECODE
    assert not d.available(102.0) and d.describe(102.0)["held_out_s"] == 30.0
    assert judge(d, now=110.0, stall_s=2.0, hold_s=30.0) is Verdict.DECODE  # a second stream: the hold goes on
    assert not d.available(139.9) and d.available(140.0)
    d.hold_out(120.0)  # a shorter hold never cuts a longer one
    assert d.held_until == 140.0


def test_a_held_out_decode_is_neither_picked_nor_paired_until_its_hold_passes():
    p = Worker("http://p", "prefill", 8998, healthy=True)
    x, y = Worker("http://x", "decode", healthy=True), Worker("http://y", "decode", healthy=True)
    pool = WorkerPool(static=[p, x, y], policy=Policy.ROUND_ROBIN)
    verifier = PairVerifier(pool)
    verifier.refresh()
    for pair in [(p, x), (p, y)]:
        verifier.passed(*pair)
    x.hold_out(time.monotonic() + 60)
    assert {pool.pick("decode") for _ in range(6)} == {y}
    assert {verifier.pick_pair() for _ in range(6)} == {(p, y)}
    assert not verifier.usable(p, x) and "held out" in verifier.unready_reason()
    y.hold_out(time.monotonic() + 60)
    assert pool.pick("decode") is None and verifier.pick_pair() is None and not verifier.ready()
    x.held_until = y.held_until = 0.0
    assert {pool.pick("decode") for _ in range(6)} == {x, y} and verifier.ready()


def test_a_choice_migrates_for_a_stall_once_and_for_other_failures_as_the_limit_allows():
    assert may_migrate("stall", stalls=1) and not may_migrate("stall", stalls=2)
    for cause in ("connection", "ended", "timeout", "error_event"):
        assert may_migrate(cause, stalls=0) and may_migrate(cause, stalls=1) and may_migrate(cause, stalls=2)
