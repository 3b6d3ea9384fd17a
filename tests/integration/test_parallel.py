"""Tensor- and pipeline-parallel instances as real processes (gloo on the CPU, Mooncake TCP):
the same greedy tokens as a single-rank server, monolithic and through the router, and every
rank's queues empty afterwards."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import random
import time

import aiohttp
import pytest
import requests

from disagg_worker.model.tiny import make_tiny
from tests.integration.procs import PDStack, Proc, free_port, scaled, serve, wait_until
from tests.integration.test_pd import FLAGS, LAYERWISE, assert_clean
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory) -> str:
    """One KV head: with two tensor ranks, both hold it (the replication path)."""
    out = tmp_path_factory.mktemp("tiny-mqa")
    make_tiny(out, num_kv_heads=1)
    return str(out)


def expected_tokens(model: str, prompts: list[list[int]]) -> list[list[int]]:
    ref = serve(model, *FLAGS).wait_healthy()
    try:
        return [generate(ref.url, p) for p in prompts]
    finally:
        ref.stop()


def concurrently(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: generate(url, p), prompts))


def rank_queues(url: str) -> list[dict]:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()["rank_queues"]


@pytest.mark.parametrize("flags", [("--tp-size", "2"), ("--pp-size", "2")], ids=["tp2", "pp2"])
def test_monolithic_ranks_equal_a_single_rank(mqa_model, flags):
    prompts = varied_prompts(16)
    assert sum(len(p) > 32 for p in prompts) >= 4  # several prompts take more than one chunk
    expected = expected_tokens(mqa_model, prompts)
    par = serve(mqa_model, *FLAGS, *flags).wait_healthy()
    try:
        assert concurrently(par.url, prompts) == expected
        assert_clean(par.url)
    finally:
        par.stop()


# Prefill streams prompts of 40 tokens or more layer by layer (every rank its own layers and heads), the others whole.
PD_MAPPINGS = {
    "prefill-tp2-decode-tp1": (("--tp-size", "2", *LAYERWISE), ()),
    "prefill-tp1-decode-tp2": (LAYERWISE, ("--tp-size", "2")),
    "prefill-pp2-decode-pp1": (("--pp-size", "2", *LAYERWISE), ()),
    "prefill-pp2-decode-pp2": (("--pp-size", "2", *LAYERWISE), ("--pp-size", "2")),
}


@pytest.mark.parametrize("mapping", list(PD_MAPPINGS))
def test_pd_across_rank_mappings_equals_a_single_rank(mqa_model, mapping):
    prefill_flags, decode_flags = PD_MAPPINGS[mapping]
    prompts = varied_prompts(16)
    expected = expected_tokens(mqa_model, prompts)
    stack = PDStack(mqa_model, *FLAGS, prefill_flags=prefill_flags, decode_flags=decode_flags).wait_healthy()
    try:
        assert concurrently(stack.router.url, prompts) == expected
        assert_clean(stack.prefill.url, stack.decode.url)
        for url in (stack.prefill.url, stack.decode.url):
            ranks = rank_queues(url)
            assert {(r["tp_rank"], r["pp_rank"]) for r in ranks} >= {(0, 0)}
            assert all(not any(r["queues"].values()) for r in ranks), ranks
    finally:
        stack.stop()


def test_a_failure_on_a_later_stage_alone_is_drained_at_once(tiny_model):
    """The orphan fix: stage 1 of a PP=2 prefill fails its sender locally while stage 0 still waits
    for a decode that never comes. The request fails at once (not at the bootstrap timeout, 12 times the
    bound on any machine) and no stage keeps it in its bootstrap queue."""
    port, boot = free_port(), free_port()
    prefill = Proc(
        [
            "prefill",
            "--model",
            tiny_model,
            "--port",
            str(port),
            "--bootstrap-port",
            str(boot),
            "--pp-size",
            "2",
            "--bootstrap-timeout",
            f"{scaled(60):g}",
            *FLAGS,
        ],
        port,
        env={"DISAGG_FAULT_FAIL_SENDERS_ON_STAGE": "1"},
    ).wait_healthy()
    try:
        body = {
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 4},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": boot,
            "bootstrap_room": 12345,
        }
        start = time.monotonic()
        r = requests.post(f"{prefill.url}/generate", json=body, timeout=scaled(60))
        elapsed = time.monotonic() - start
        answered = time.time()  # the clock of the scheduler's reports
        assert r.status_code == 500, r.text
        assert "injected local failure" in r.json()["error"]["message"]
        assert elapsed < scaled(5), f"the failure took {elapsed:.1f}s to reach the client"

        def stages_empty() -> bool:
            # A report made before the request arrived shows empty queues too: only a later one says they emptied.
            st = requests.get(f"{prefill.url}/stats", timeout=scaled(5)).json()
            return st["time"] >= answered and all(
                r["queues"].get("prefill_bootstrap", 0) == 0 for r in st["rank_queues"]
            )

        wait_until(stages_empty, timeout=5, what="every stage's bootstrap queue empty in a report after the failure")
        assert {(r["tp_rank"], r["pp_rank"]) for r in rank_queues(prefill.url)} == {(0, 0), (0, 1)}
        assert_clean(prefill.url)
    finally:
        prefill.stop()


MISMATCHES = {
    "page-size": ((), ("--page-size", "8"), ["page size mismatch", "prefill page_size=4", "decode page_size=8"]),
    "decode-pp3-prefill-pp2": (
        ("--pp-size", "2"),
        ("--pp-size", "3"),
        ["unsupported PP mapping", "prefill pp_size=2", "decode pp_size=3"],
    ),
}


@pytest.mark.parametrize("mismatch", list(MISMATCHES))
def test_a_mismatched_pair_is_never_served_and_the_router_says_why(tiny_model, mismatch):
    """The router's verification request meets the handshake's refusal at once (not after a bootstrap timeout):
    the pair never becomes ready, /health and /ready name the mismatch, and a client's request is refused with a
    503 and Retry-After whose message names no worker (the workers' addresses stay in the router's log)."""
    prefill_flags, decode_flags, words = MISMATCHES[mismatch]
    stack = PDStack(tiny_model, *FLAGS, prefill_flags=prefill_flags, decode_flags=decode_flags)
    try:
        stack.prefill.wait_healthy()
        stack.decode.wait_healthy()
        healthy_at = time.monotonic()

        def named() -> tuple[int, dict] | None:
            try:  # the router may still be starting when both workers are healthy
                r = requests.get(f"{stack.router.url}/health", timeout=scaled(5))
            except requests.ConnectionError:
                return None
            pairs = r.json().get("pairs") or []
            return (r.status_code, r.json()) if pairs and all(w in pairs[0]["error"] for w in words) else None

        status, health = wait_until(named, timeout=30, interval=0.2, what="the router's /health naming the mismatch")
        elapsed = time.monotonic() - healthy_at
        assert elapsed < scaled(5), f"the mismatch was named {elapsed:.1f}s after both sides were healthy"
        assert status == 503 and not health["pairs"][0]["verified"], health
        ready = requests.get(f"{stack.router.url}/ready", timeout=scaled(5))
        assert ready.status_code == 503 and all(w in ready.json()["reason"] for w in words), ready.text
        r = requests.post(f"{stack.router.url}/generate", json={"input_ids": [5, 6, 7]}, timeout=scaled(60))
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
        message = r.json()["error"]["message"]
        assert "retry later" in message and "http://" not in message and stack.decode.url not in message, message
    finally:
        stack.stop()


def test_a_thousand_aborts_at_random_stages_leave_every_rank_clean(tiny_model):
    """Prefill PP=2, decode TP=2 (head slices across the mismatched sizes): clients give up at
    random moments (bootstrap, prefill forward, KV transfer, decoding); afterwards every rank's
    queues are empty, every page is free, and fresh requests still get the single-rank tokens."""
    prompts = varied_prompts(8)
    expected = expected_tokens(tiny_model, prompts)
    stack = PDStack(
        tiny_model, *FLAGS, prefill_flags=("--pp-size", "2", *LAYERWISE), decode_flags=("--tp-size", "2")
    ).wait_healthy()
    try:
        outcomes = asyncio.run(abandon_requests(stack.router.url, n=1000, seed=3))
        # Every patient request (one in PATIENT) waited for its answer, and got it; of the others, most gave up.
        assert outcomes["patient_completed"] == 1000 // PATIENT, outcomes
        assert outcomes["aborted"] >= 300, outcomes
        assert_clean(stack.prefill.url, stack.decode.url)
        for url in (stack.prefill.url, stack.decode.url):
            ranks = rank_queues(url)
            assert len(ranks) == 2 and all(not any(r["queues"].values()) for r in ranks), ranks
        assert concurrently(stack.router.url, prompts) == expected
    finally:
        stack.stop()


PATIENT = 20


async def abandon_requests(url: str, n: int, seed: int) -> dict[str, int]:
    """`n` requests through the router, each abandoned after a random time (some finish first), except every
    PATIENT-th one, which waits for its answer: those finish among the aborts, whatever the machine's speed."""
    rng = random.Random(seed)
    counts = {"aborted": 0, "completed": 0, "refused": 0, "patient_completed": 0}
    limit = asyncio.Semaphore(48)

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        body = {
            "input_ids": [rng.randrange(10, 2000) for _ in range(rng.choice([3, 30, 90]))],
            "sampling_params": {"max_new_tokens": rng.choice([1, 8, 32]), "temperature": 0, "ignore_eos": True},
        }
        patient = i % PATIENT == 0
        # 5 ms to 5 s on a quiet machine, log-uniform; the moments stretch with the machine, as its stages do.
        patience = scaled(120 if patient else 0.005 * 1000 ** rng.random())
        async with limit:
            try:
                async with asyncio.timeout(patience):
                    async with session.post(f"{url}/generate", json=body) as r:
                        await r.read()
                        counts["completed" if r.status == 200 else "refused"] += 1
                        counts["patient_completed"] += patient and r.status == 200
            except TimeoutError:
                counts["aborted"] += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(i, session) for i in range(n)))
    return counts
