"""`--scheduling-policy priority`: a request's `priority` (an integer, higher first) parsed and checked on every
endpoint, the waiting queue's order, and the engine admitting, retracting and preempting requests by it, each
request's tokens those it has alone and every page back at idle; fcfs ignores it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_api import settings as S
from disagg_worker.config import Role
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.engine.waiting import POLICIES, FcfsQueue, PriorityQueue, waiting_queue
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg
from disagg_worker.request.params import PRIORITY_MAX, PRIORITY_MIN
from disagg_worker.router.payload import SharedBody
from tests.unit.test_engine import assert_idle_accounting, make_engine, run_all, tokens_of, varied_prompts
from tests.unit.test_pd_engines import ROOMS, config
from tests.unit.test_protocol import USER, chat, completion, error, generate

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


# ---- the request's field ------------------------------------------------------------------------
def test_priority_is_read_on_every_endpoint_and_defaults_to_zero():
    assert completion({"prompt": "x"}).sampling.priority == 0
    assert completion({"prompt": "x", "priority": 7}).sampling.priority == 7
    assert chat({"messages": USER, "priority": -3}).sampling.priority == -3
    assert generate({"input_ids": [1, 2], "priority": PRIORITY_MAX}).sampling.priority == PRIORITY_MAX
    assert generate({"text": "hi", "priority": PRIORITY_MIN}).sampling.priority == PRIORITY_MIN


BAD = ["high", 1.5, True, False, [1], {"p": 1}, PRIORITY_MAX + 1, PRIORITY_MIN - 1, 10**50]


@pytest.mark.parametrize("value", BAD)
def test_a_priority_that_is_not_a_bounded_integer_is_a_400_naming_it(value):
    bodies = [
        (completion, {"prompt": "x", "priority": value}),
        (chat, {"messages": USER, "priority": value}),
        (generate, {"input_ids": [1, 2], "priority": value}),
    ]
    for parse, body in bodies:
        e = error(parse, body)
        assert (e.status, e.param) == (400, "priority")
        assert e.message.startswith("priority: ")


def test_the_engine_refuses_an_out_of_range_priority_too():
    """The scheduler checks what the HTTP process checked (`Engine.arrive`): the same rule, the same name."""
    assert SamplingParams(priority=PRIORITY_MAX).problem() == ""
    assert SamplingParams(priority=PRIORITY_MAX + 1).problem().startswith("priority: must be <=")
    assert SamplingParams(priority=True).problem().startswith("priority: must be an integer")  # type: ignore[arg-type]


# ---- the waiting queue --------------------------------------------------------------------------
@dataclass(eq=False)
class Waiting:
    """What a waiting queue reads of a request."""

    rid: str
    priority: int
    arrival: float
    params: SamplingParams = field(init=False)

    def __post_init__(self) -> None:
        self.params = SamplingParams(priority=self.priority)


def test_the_policies_are_the_settings_choices():
    assert tuple(POLICIES) == S.SCHEDULING_POLICY.choices and S.SCHEDULING_POLICY.default == "fcfs"
    assert isinstance(waiting_queue("fcfs"), FcfsQueue) and isinstance(waiting_queue("priority"), PriorityQueue)


def test_fcfs_keeps_arrival_order_and_puts_a_retracted_request_first():
    q = FcfsQueue()
    a, b, c = Waiting("a", 0, 1.0), Waiting("b", 9, 2.0), Waiting("c", -9, 3.0)
    for r in (a, b, c):
        q.add(r)
    assert [r.rid for r in q] == ["a", "b", "c"]
    q.remove(a)
    q.requeue(a)
    assert [r.rid for r in q] == ["a", "b", "c"]
    assert q.victim([a, b, c], a) is c  # the newest admitted, whatever its priority
    assert q.victim([], a) is None
    assert q.preemptee(b, [a, c]) is None  # a waiting request never preempts a running one


def test_priority_retracts_the_lowest_priority_then_the_latest_arrived_never_one_above_the_beneficiary():
    q = PriorityQueue()
    low_old, low_new, mid, high = (
        Waiting("lo", -1, 1.0),
        Waiting("lo2", -1, 5.0),
        Waiting("m", 1, 0.0),
        Waiting("hi", 3, 9.0),
    )
    assert q.victim([low_new, high, low_old], high) is low_new
    assert q.victim([high, mid], mid) is mid and q.victim([high], mid) is None
    assert q.victim([low_old], low_new) is low_old  # equal priorities: running ones may make room for each other


def test_a_waiting_request_preempts_only_running_ones_of_strictly_lower_priority():
    q = PriorityQueue()
    low_old, low_new, mid, high = (
        Waiting("lo", -1, 1.0),
        Waiting("lo2", -1, 5.0),
        Waiting("m", 1, 0.0),
        Waiting("hi", 3, 9.0),
    )
    assert q.preemptee(high, [low_old, mid, low_new]) is low_new
    assert q.preemptee(mid, [high, low_old]) is low_old
    assert q.preemptee(mid, [high, Waiting("m2", 1, 9.0)]) is None  # never one of its own priority


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(-3, 3), st.integers(0, 5)),
        st.tuples(st.just("admit"), st.just(0), st.just(0)),
        st.tuples(st.just("remove"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("requeue"), st.integers(0, 50), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(OPS)
def test_priority_order_is_highest_first_then_arrival_and_nothing_is_lost(ops):
    """Whatever is added, admitted (the first taken), removed or retracted, the queue holds exactly what is left,
    in the total order (-priority, arrival), ties kept in the order they were added."""
    q, present, out, added = PriorityQueue(), {}, [], 0  # present: request -> when it was last added
    for op, x, y in ops:
        if op == "add":
            r = Waiting(f"r{added}", x, float(y))
        elif op == "requeue" and out:
            r = out.pop(x % len(out))
        elif op in ("admit", "remove") and present:
            r = next(iter(q)) if op == "admit" else list(present)[x % len(present)]
            q.remove(r)
            del present[r]
            out.append(r)
            continue
        else:
            continue
        (q.add if op == "add" else q.requeue)(r)
        present[r], added = added, added + 1
    order = [r for r in q]
    assert len(q) == len(order) == len(present) and set(order) == set(present)
    assert order == sorted(present, key=lambda r: (-r.priority, r.arrival, present[r]))


# ---- the engine ---------------------------------------------------------------------------------
def first_output_order(engine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[list[str], dict]:
    """The requests' ids in the order their first tokens came out, and their tokens; all are waiting before the
    first step."""
    stepper = Stepper(engine)
    for i, (ids, params) in enumerate(requests):
        engine.handle(msg.GenerateReq(str(i), ids, params))
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while stepper.busy:
        stepper.step()
        for o in engine.take_outputs():
            if o.token_ids and o.rid not in order:
                order.append(o.rid)
            tokens.setdefault(o.rid, []).extend(o.token_ids)
    stepper.close()
    return order, tokens


PRIORITIES = [0, 0, 5, -1, 5, 2]


@pytest.mark.parametrize("policy,expected", [("priority", "245013"), ("fcfs", "012345")])
def test_requests_are_admitted_by_priority_under_priority_and_by_arrival_under_fcfs(tiny_model, policy, expected):
    """One running slot: each request runs alone, in the order admitted. Under priority the highest first, equal
    priorities in arrival order; under fcfs arrival order whatever their priorities. Each gets the same tokens."""
    prompts = varied_prompts(len(PRIORITIES), seed=5)
    requests = [(p, replace(GREEDY, priority=pr)) for p, pr in zip(prompts, PRIORITIES, strict=True)]
    engine = make_engine(tiny_model, max_running=1, overlap=False, policy=policy)
    order, tokens = first_output_order(engine, requests)
    assert "".join(order) == expected
    alone = make_engine(tiny_model, max_running=1, overlap=False)
    assert tokens == {str(i): tokens_of(run_all(alone, [r], overlap=False)["0"]) for i, r in enumerate(requests)}


@pytest.fixture(scope="module")
def pressed(tiny_model):
    """16 requests of three priorities, too many for 128 tokens of KV at once, and each one's tokens alone."""
    prompts = varied_prompts(16, seed=1)
    params = [replace(GREEDY, max_new_tokens=30, priority=i % 3) for i in range(len(prompts))]
    alone = make_engine(tiny_model, cache=False, chunk=0, overlap=False, max_running=1)
    expected = [tokens_of(run_all(alone, [r], overlap=False)["0"]) for r in zip(prompts, params, strict=True)]
    return prompts, params, expected


@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_by_priority_under_page_pressure_keeps_outputs_and_pages(tiny_model, pressed, overlap, caplog):
    """Too few pages for all at once: requests are retracted (the lowest priority first) and computed again, with
    the tokens they would have had alone; at idle every page is free or cached (`run_all`)."""
    prompts, params, expected = pressed
    engine = make_engine(tiny_model, tokens=128, chunk=16, overlap=overlap, policy="priority")
    caplog.set_level("INFO", logger="disagg_worker.engine.scheduler")
    out = run_all(engine, list(zip(prompts, params, strict=True)), overlap=overlap)
    assert [tokens_of(out[str(i)]) for i in range(len(prompts))] == expected
    assert any("retracted" in r.message for r in caplog.records)


def stepped(engine, requests, arrive_later: dict[int, int]) -> tuple[list[tuple[str, int]], dict[str, list[int]]]:
    """Run `requests` (request i arrives before step `arrive_later.get(i, 0)`): the (id, step) of each output with
    tokens or a finish, and each request's tokens."""
    stepper = Stepper(engine)
    events: list[tuple[str, int]] = []
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or stepper.busy or len(tokens) < len(requests):
        for i, (ids, params) in enumerate(requests):
            if arrive_later.get(i, 0) == step:
                engine.handle(msg.GenerateReq(str(i), ids, params))
        stepper.step()
        step += 1
        assert step < 5000, "the engine did not finish"
        for o in engine.take_outputs():
            tokens.setdefault(o.rid, []).extend(o.token_ids)
            if o.finish_reason:
                events.append((o.rid, step))
    stepper.close()
    assert_idle_accounting(engine)
    return events, tokens


def alone_tokens(tiny_model, requests) -> dict[str, list[int]]:
    engine = make_engine(tiny_model, cache=False, chunk=0, overlap=False, max_running=1)
    return {str(i): tokens_of(run_all(engine, [r], overlap=False)["0"]) for i, r in enumerate(requests)}


LONG = replace(GREEDY, max_new_tokens=40)


@pytest.mark.parametrize("policy,first", [("priority", "1"), ("fcfs", "0")])
def test_a_higher_priority_request_preempts_the_one_in_the_only_running_slot(tiny_model, policy, first):
    """One running slot, held by a long low-priority request: a high-priority one arriving later takes it under
    priority (the low one is retracted, then finishes after it with the tokens it would have had alone); under fcfs
    it waits for the slot."""
    prompts = varied_prompts(2, seed=7)
    requests = [(prompts[0], replace(LONG, priority=-1)), (prompts[1], replace(GREEDY, priority=4))]
    engine = make_engine(tiny_model, max_running=1, overlap=False, policy=policy)
    events, tokens = stepped(engine, requests, arrive_later={1: 5})
    assert events[0][0] == first
    assert tokens == alone_tokens(tiny_model, requests)


@pytest.mark.parametrize("policy,order", [("priority", ["1", "0"]), ("fcfs", ["0", "1"])])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_higher_priority_request_that_does_not_fit_preempts_a_lower_one_and_pages_balance(
    tiny_model, overlap, policy, order, caplog
):
    """64 tokens of KV: a running low-priority request leaves too few pages for a high-priority prompt, which
    under priority preempts it (retracted, its pages released) and finishes first; the low one then finishes with
    the tokens it would have had alone, and at idle every page is free or cached (`stepped`). Under fcfs the high
    one waits for the pages."""
    prompts = [list(range(100, 130)), list(range(200, 224))]
    requests = [(prompts[0], replace(GREEDY, max_new_tokens=24, priority=0)), (prompts[1], replace(GREEDY, priority=1))]
    engine = make_engine(tiny_model, tokens=64, chunk=8, overlap=overlap, policy=policy)
    caplog.set_level("INFO", logger="disagg_worker.engine.scheduler")
    events, tokens = stepped(engine, requests, arrive_later={1: 6})
    assert [rid for rid, _ in events] == order
    assert any(r.message.startswith("retracted 0 ") for r in caplog.records) == (policy == "priority")
    assert tokens == alone_tokens(tiny_model, requests)


# ---- P/D ----------------------------------------------------------------------------------------
def test_the_router_passes_priority_on_to_both_legs():
    body = SharedBody.of({"model": "m", "prompt": "x", "priority": 3, "stream": True})
    assert json.loads(body.payload(n=1, bootstrap_room=7).decode())["priority"] == 3


def test_the_router_forwards_the_priority_its_flow_control_gave_over_the_clients():
    from disagg_worker.router.server import parse_request

    class NoPrompts:
        prompts = None

        def prompt_of(self, path, body):
            return None

    raw = json.dumps({"model": "m", "prompt": "x", "priority": 9}).encode()
    for gave, forwarded in ((1, 1), (None, 9)):  # capped by flow control; flow control off: the client's own
        (part,), _ = parse_request(raw, NoPrompts(), "/v1/completions", gave)
        assert json.loads(part.body.payload(n=1).decode())["priority"] == forwarded


@pytest.mark.parametrize("policy,expected", [("priority", [3, 7, 2, 6, 1, 5, 0, 4]), ("fcfs", list(range(8)))])
def test_decode_preallocates_in_the_policys_order(tiny_model, policy, expected):
    """64 pages of 4 tokens on decode, two requests of 100 tokens at a time: those waiting in the prealloc queue get
    their pages by priority (by arrival among equals) under priority, by arrival under fcfs."""
    pd = [config(tiny_model, Role.PREFILL), config(tiny_model, Role.DECODE, tokens=256, max_running=4)]
    p, d = (load_engine(replace(c, scheduler=replace(c.scheduler, scheduling_policy=policy))) for c in pd)
    try:
        sp, sd = Stepper(p), Stepper(d)
        for i in range(8):
            params = replace(GREEDY, max_new_tokens=4, priority=i % 4)
            info = msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))
            p.handle(msg.GenerateReq(f"p{i}", list(range(20 + i, 120 + i)), params, info))
            d.handle(msg.GenerateReq(f"d{i}", list(range(20 + i, 120 + i)), params, info))
        order: list[int] = []
        for _ in range(5000):
            if not (sp.busy or sd.busy):
                break
            sp.step()
            sd.step()
            held = [*d.stage.transfer, *(r.rid for r in d.scheduler.running)]  # preallocated: in transfer, then running
            order += [int(rid[1:]) for rid in held if int(rid[1:]) not in order]
            p.take_outputs(), d.take_outputs()
        sp.close()
        sd.close()
        assert order == expected
        for e in (p, d):
            e.handle(msg.FlushCacheReq())
            assert e.allocator.num_free == e.allocator.num_total
    finally:
        p.close()
        d.close()
