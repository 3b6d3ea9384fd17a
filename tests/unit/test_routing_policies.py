"""The routing policies on their own (`router/policies/`): the registry is the flag's choices, and each policy,
handed a small pool of workers built by hand, picks what a user would expect; the pool hands them only healthy,
non-excluded workers, and the package runs without the router's HTTP side."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from disagg_api import router_settings as R
from disagg_operator.crd_roles import router_schema
from disagg_worker.mem.kv_events import EventLog, page_hashes
from disagg_worker.router.args import add_router_args
from disagg_worker.router.kv_index import KVIndex
from disagg_worker.router.policies import POLICIES, Policy, make_policy
from disagg_worker.router.policies.cache_aware import CacheAware
from disagg_worker.router.policies.least_load import LeastLoad
from disagg_worker.router.policies.prefix import PrefixScore, Prompt
from disagg_worker.router.policies.round_robin import RoundRobin
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool

PAGE = 4
SYSTEM = list(range(100, 228))  # 32 pages


def prompt(ids: list[int]) -> Prompt:
    return Prompt(len(ids), page_hashes(ids, PAGE), PAGE)


def workers(role: str, *names: str) -> list[Worker]:
    return [Worker(f"http://{n}", role, 1 if role == "prefill" else 0, healthy=True) for n in names]


def holding(index: KVIndex, w: Worker, ids: list[int]) -> None:
    """Index `w` as holding the pages of `ids`, as its /kv_events would say."""
    log = EventLog(PAGE, "m")
    log.apply(0, [("stored", page_hashes(ids, PAGE))])
    index.of(w.url).apply(log.since("", -1), time.monotonic())


def test_the_registry_holds_the_flags_choices_and_the_crds_enum():
    p = argparse.ArgumentParser()
    add_router_args(p)
    choices = next(a.choices for a in p._actions if "--policy" in a.option_strings)
    assert list(POLICIES) == list(choices) == list(R.POLICIES) == [p.value for p in Policy]
    assert router_schema()["properties"]["policy"]["enum"] == list(POLICIES)
    for name in POLICIES:
        assert {"indexed", "pick", "decode_only"} <= set(dir(make_policy(name, PrefixScore())))
    with pytest.raises(ValueError, match="unknown routing policy 'random'.*cache_aware"):
        make_policy("random", PrefixScore())


def test_least_load_picks_the_idle_worker_then_the_one_with_less_kv_in_use():
    a, b, c = workers("decode", "a", "b", "c")
    a.inflight, b.inflight = 2, 1
    policy = LeastLoad()
    assert policy.pick("decode", [a, b, c], None) is c
    c.report = {"load": {"requests": 3}}  # other routers' requests, as its /health says
    assert policy.pick("decode", [a, b, c], None) is b
    a.inflight, b.report = 1, {"load": {"requests": 1, "kv_used": 90, "kv_total": 100}}
    assert policy.pick("decode", [a, b, c], None) is a  # as many requests: the one with less of its KV in use
    assert not any(policy.indexed(w) for w in (a, b, c))


def test_round_robin_cycles_through_each_roles_workers_on_its_own():
    p1, p2 = workers("prefill", "p1", "p2")
    d1, d2 = workers("decode", "d1", "d2")
    policy = RoundRobin()
    picks = [(policy.pick("prefill", [p1, p2], None), policy.pick("decode", [d1, d2], None)) for _ in range(4)]
    assert picks == [(p1, d1), (p2, d2), (p1, d1), (p2, d2)]
    d1.inflight = 5  # blind to load
    assert [policy.pick("decode", [d1, d2], None) for _ in range(2)] == [d1, d2]
    assert not policy.indexed(p1) and not policy.decode_only(d1, prompt(SYSTEM))


def test_cache_aware_picks_the_worker_holding_the_prefix_and_balances_off_a_busy_one():
    a, b = workers("prefill", "a", "b")
    score = PrefixScore(balance_tokens=64)
    holding(score.index, b, SYSTEM)
    policy = CacheAware(score)
    follow_up = prompt(SYSTEM + [1, 2])
    assert policy.pick("prefill", [a, b], follow_up) is b  # 2 tokens to compute on b, 130 on a
    assert policy.pick("prefill", [a, b], prompt([7] * 12)) in (a, b)  # a miss: both cost the same
    b.pending_tokens = 40
    assert policy.pick("prefill", [a, b], prompt([7] * 12)) is a  # a miss goes where less is pending
    assert policy.pick("prefill", [a, b], follow_up) is b  # 2 + 40 pending against 130: still b
    b.pending_tokens = 64  # at the guard, while a idles: a takes it, though b is cheaper still
    assert policy.pick("prefill", [a, b], follow_up) is a
    a.inflight = 1  # nobody idles: the cost decides again
    assert policy.pick("prefill", [a, b], follow_up) is b
    assert score.decisions == {"cache_hit": 3, "load": 2, "balanced": 1}
    assert policy.indexed(a) and not policy.indexed(workers("decode", "d")[0])


def test_cache_aware_sends_a_prompt_to_the_decode_that_can_compute_it_alone():
    d1, d2 = workers("decode", "d1", "d2")
    for d in (d1, d2):
        d.report = {"local_prefill": True}
    score = PrefixScore(decode_only_tokens=8)
    holding(score.index, d2, SYSTEM)
    policy = CacheAware(score)
    d2.inflight = 3  # busier, but it holds the history
    follow_up = prompt(SYSTEM + [1, 2])
    d = policy.pick("decode", [d1, d2], follow_up)
    assert d is d2 and policy.decode_only(d, follow_up)
    long = prompt(list(range(700, 764)))
    d = policy.pick("decode", [d1, d2], long)
    assert d is d1 and not policy.decode_only(d, long)  # nobody holds it: decode by load, with a prefill
    assert score.decisions == {"decode_only": 1} and policy.indexed(d1)


def test_the_pool_hands_its_policy_only_healthy_workers_not_excluded():
    a, b, c = workers("decode", "a", "b", "c")
    b.healthy = False
    pool = WorkerPool(static=[a, b, c], policy=Policy.ROUND_ROBIN)
    assert [pool.pick("decode") for _ in range(3)] == [a, c, a]
    assert [pool.pick("decode", exclude={a}) for _ in range(2)] == [c, c]
    assert pool.pick("decode", exclude={a, c}) is None and pool.pick("prefill") is None
    assert isinstance(WorkerPool(policy=Policy.CACHE_AWARE).routing, CacheAware)


def test_the_policies_run_without_the_routers_http_side():
    code = "import sys, disagg_worker.router.policies; print(sorted(m for m in sys.modules if 'aiohttp' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
