"""Faults in a P/D deployment: every client request ends (tokens or a clear error) within its
timeout, and afterwards every queue is empty and every page free on both sides.

Each test waits until the stage it interrupts holds requests (the /stats queue gauges), injects
the fault, and asserts that it interrupted them: some requests end with an HTTP error status and a
message; a dropped connection is a failure, not a clean error. After every fault, fresh greedy
requests get the same tokens the same stack gave before it.

A decode instance that runs few requests at once (HOLD) keeps requests in the handoff stages for
seconds: the rest wait in decode's prealloc queue and prefill's bootstrap queue until a slot frees.
/stats reports every 0.5 s, so a state that lasts milliseconds could be over before a test sees it.
With layer-wise streaming, a prefill stalled by its fault hook (`DISAGG_FAULT_STALL_AFTER_LAYER_GROUP`) holds a
request between its layer groups for as long as the test needs: its first groups left, the others did not.
Both together (`held`) hold a whole load in the handoff stages until the test lets it go: the two rooms in
decode's running slots wait for KV a stalled forward does not finish, so no slot frees and every other request
waits for its destination (`hold`). How long HOLD alone keeps them there is how fast the machine decodes; under
load the requests also reach the instances spread out while the first ones decode, so that state can be brief,
missed between two reports, or never reached.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import requests

from tests.integration.procs import PDStack, Proc, reference, scaled, serve, wait_until
from tests.integration.test_pd import FLAGS, LAYERWISE, assert_clean
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration
# How long a client waits for its answer: every request, interrupted or not, ends within it.
CLIENT_TIMEOUT = scaled(40.0)
# Decode runs 2 requests at a time; prefill lets the others wait for decode's handshake long enough.
# With TOKENS per request, 8 requests held in a stage are 4 rounds of TOKENS decode steps away from
# leaving it: over a second even on a quiet machine, against /stats reports 0.5 s apart.
HOLD = {"decode_flags": ("--max-running-requests", "2"), "prefill_flags": ("--bootstrap-timeout", f"{scaled(60):g}")}
TOKENS = 100
HELD = 8


@pytest.fixture()
def stack(tiny_model):
    """A stack whose decode runs 2 requests at a time (HOLD)."""
    s = PDStack(tiny_model, *FLAGS, **HOLD).wait_healthy()
    yield s
    s.stop()


# The fault hook's line in a prefill's log each time a streamed forward stalls after its second layer group (of 4).
STALLED = "fault injected: the forward stalls after layer group 1"


def stall_env(release: Path) -> dict[str, str]:
    """Prefill stalls a layer-wise streamed forward after its second layer group while `release` does not exist."""
    return {"DISAGG_FAULT_STALL_AFTER_LAYER_GROUP": f"1:{release}"}


@pytest.fixture()
def held(tiny_model, tmp_path):
    """A HOLD stack whose prefill streams prompts of 40+ tokens layer group by layer group and stalls such a forward
    while the returned file does not exist (it does until `hold` removes it)."""
    release = tmp_path / "release"
    release.touch()
    prefill_flags = (*LAYERWISE, *HOLD["prefill_flags"])
    s = PDStack(
        tiny_model, *FLAGS, prefill_flags=prefill_flags, decode_flags=HOLD["decode_flags"], env=stall_env(release)
    ).wait_healthy()
    yield s, release
    release.touch()  # a stalled forward must not hold up the stop
    s.stop()


@pytest.fixture()
def plain(tiny_model):
    s = PDStack(tiny_model, *FLAGS).wait_healthy()
    yield s
    s.stop()


def request(url: str, seed: int, timeout: float = CLIENT_TIMEOUT, prompt_len: int = 300, max_tokens: int = TOKENS):
    """One client: ("ok", tokens), ("error", status, message), ("timeout", seconds) or ("dropped", what)."""
    rng = random.Random(seed)
    body = {
        "prompt": [rng.randrange(10, 2000) for _ in range(prompt_len)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    start = time.monotonic()
    try:
        r = requests.post(f"{url}/v1/completions", json=body, timeout=timeout)
    except requests.Timeout:
        return ("timeout", time.monotonic() - start)
    except requests.ConnectionError as e:  # not a clean failure: the server owes an answer
        return ("dropped", str(e))
    if r.status_code == 200:
        return ("ok", r.json()["usage"]["completion_tokens"])
    return ("error", r.status_code, r.json()["error"]["message"])


def load(url: str, n: int, pool: cf.ThreadPoolExecutor, **kw) -> list[cf.Future]:
    return [pool.submit(request, url, i, **kw) for i in range(n)]


def outcomes(futures: list[cf.Future]) -> list[tuple]:
    """Every request ended in time with its tokens or an HTTP error with a message; some ended in an error."""
    results = [f.result(timeout=CLIENT_TIMEOUT + scaled(10)) for f in futures]
    assert not [r for r in results if r[0] == "timeout"], "a client request hung past its timeout"
    assert not [r for r in results if r[0] == "dropped"], [r for r in results if r[0] == "dropped"][:3]
    for r in results:
        if r[0] == "ok":
            assert r[1] == TOKENS
        else:
            assert r[1] >= 500 and r[2], f"not a clean server error: {r}"
    assert any(r[0] == "error" for r in results), "the fault interrupted nothing"
    return results


def queues(url: str) -> dict[str, int]:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()["queues"]


def decode_waiting_on_prefill(url: str, at_least: int = HELD) -> bool:
    """Decode holds requests in its prealloc or transfer queue: they need the prefill side (one /stats read)."""
    q = queues(url)
    return q.get("decode_prealloc", 0) + q.get("decode_transfer", 0) >= at_least


def still_running(futures: list[cf.Future]) -> bool:
    """False while a request runs; once every one ended before the fault, what they got (nothing left to
    interrupt: the stage the test waits for can no longer come)."""
    if all(f.done() for f in futures):
        raise AssertionError(f"every request ended before the fault: {[f.result() for f in futures][:4]}")
    return False


def stalls(proc: Proc) -> int:
    return Path(proc.log.name).read_text(errors="replace").count(STALLED)


def hold(stack: PDStack, release: Path, n: int, pool: cf.ThreadPoolExecutor, **kw) -> list[cf.Future]:
    """Send `n` requests (prompts of 40+ tokens) to a stack whose prefill stalls streamed forwards (`held`), and
    return once decode holds every one of them waiting on prefill: a state that lasts until `release` exists again.
    Prefill's first forward stalls after its first layer groups left, so the (at most 2, HOLD) rooms decode sent
    destinations for are mid-transfer and keep its running slots; every other request waits in decode's prealloc
    queue for a destination decode sends only when a slot frees, and prefill holds its room Bootstrapping."""
    seen = stalls(stack.prefill)
    release.unlink()
    futures = load(stack.router.url, n, pool, **kw)
    wait_until(
        lambda: stalls(stack.prefill) > seen or still_running(futures),
        timeout=30,
        interval=0.05,
        what="prefill stalled in a streamed forward",
    )
    wait_until(
        lambda: decode_waiting_on_prefill(stack.decode.url, n) or still_running(futures),
        timeout=30,
        interval=0.05,
        what=f"decode holding all {n} requests in its prealloc and transfer queues",
    )
    return futures


def wait_router_healthy(stack: PDStack) -> None:
    wait_until(
        lambda: requests.get(f"{stack.router.url}/health", timeout=scaled(5)).status_code == 200,
        timeout=30,
        what="router healthy",
    )


def test_kill_decode_mid_transfer(held):
    """kill -9 of decode while prefill holds a load in its handoff: the 2 rooms of a stalled streamed forward have
    sent their first layer groups to decode and send the rest to a dead peer once the forward goes on; every other
    room waits for a destination that never comes. Every prefill page comes back."""
    stack, release = held
    before = reference(stack.router.url)
    with cf.ThreadPoolExecutor(24) as pool:
        futures = hold(stack, release, 24, pool)  # each one waits on prefill until it is released
        stack.decode.kill()
        release.touch()  # the stalled forward goes on, towards a dead decode
        outcomes(futures)
    assert_clean(stack.prefill.url)
    stack.decode = stack.start_decode(stack.decode.port).wait_healthy()
    wait_router_healthy(stack)
    assert request(stack.router.url, 999)[0] == "ok"
    assert reference(stack.router.url) == before
    assert_clean(stack.prefill.url, stack.decode.url)


def test_kill_prefill_mid_bootstrap(held):
    """kill -9 of prefill while decode holds every request waiting on it: 2 rooms mid-transfer (their first layer
    groups landed), every other one in decode's prealloc queue. Decode fails them all and frees every page."""
    stack, release = held
    before = reference(stack.router.url)
    with cf.ThreadPoolExecutor(24) as pool:
        futures = hold(stack, release, 24, pool)  # each one waits on prefill until it is released
        stack.prefill.kill()
        release.touch()  # the restarted prefill must not stall its streamed forwards
        outcomes(futures)
    assert_clean(stack.decode.url)
    # Decode reconnects to a restarted prefill instance without being restarted itself.
    stack.prefill = stack.start_prefill(stack.prefill.port).wait_healthy()
    wait_router_healthy(stack)
    wait_until(
        lambda: request(stack.router.url, 1000)[0] == "ok",
        timeout=60,
        interval=1,
        what="a request through the restarted prefill",
    )
    assert reference(stack.router.url) == before
    assert_clean(stack.prefill.url, stack.decode.url)


def test_a_prefill_restarted_on_its_address_under_load_is_a_new_peer_to_decode(stack):
    """kill -9 of prefill while clients keep sending, and a new prefill process on the same address at once: decode
    drops what it knew of the old one (sessions, buffer addresses, rooms), so every request that starts once the
    router is healthy again is answered, and the answers are the ones the stack gave before."""
    before = reference(stack.router.url)
    stop = threading.Event()
    seen: list[tuple[float, tuple]] = []  # (start, outcome) of every request

    def client(k: int) -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            start = time.monotonic()
            seen.append((start, request(stack.router.url, 5000 + 100 * k + i % 7)))

    with cf.ThreadPoolExecutor(6) as pool:
        clients = [pool.submit(client, k) for k in range(6)]
        wait_until(
            lambda: decode_waiting_on_prefill(stack.decode.url, 4), timeout=30, interval=0.02, what="decode waiting"
        )
        stack.prefill.kill()
        stack.prefill = stack.start_prefill(stack.prefill.port).wait_healthy()
        wait_router_healthy(stack)
        healthy = time.monotonic()
        wait_until(
            lambda: sum(start > healthy and r[0] == "ok" for start, r in list(seen)) >= 12,
            timeout=120,
            interval=0.5,
            what="12 requests answered through the new prefill while the load goes on",
        )
        stop.set()
        for c in clients:
            c.result(timeout=CLIENT_TIMEOUT + scaled(10))
    results = [r for _, r in seen]
    assert not [r for r in results if r[0] in ("timeout", "dropped")], [r for r in results if r[0] != "ok"][:3]
    assert any(r[0] == "error" for r in results), "the kill interrupted nothing"
    assert all(r[1] >= 500 and r[2] for r in results if r[0] == "error"), [r for r in results if r[0] == "error"]
    after = [r for start, r in seen if start > healthy]
    assert all(r == ("ok", TOKENS) for r in after), [r for r in after if r[0] != "ok"][:3]
    assert reference(stack.router.url) == before
    assert_clean(stack.prefill.url, stack.decode.url)


def test_bootstrap_server_stops_answering(held):
    """The prefill instance (and its bootstrap server) freezes: decode's heartbeat fails its rooms."""
    stack, release = held
    before = reference(stack.router.url)
    with cf.ThreadPoolExecutor(16) as pool:
        futures = hold(stack, release, 16, pool)  # each one waits on prefill until it is released
        os.killpg(stack.prefill.proc.pid, signal.SIGSTOP)
        release.touch()  # the stalled forward goes on only once prefill runs again
        try:
            outcomes(futures)
        finally:
            os.killpg(stack.prefill.proc.pid, signal.SIGCONT)
    assert_clean(stack.prefill.url, stack.decode.url)
    wait_until(
        lambda: request(stack.router.url, 2000)[0] == "ok",
        timeout=60,
        interval=1,
        what="serving again after the bootstrap server came back",
    )
    assert reference(stack.router.url) == before


def test_abort_1000_requests_at_random_stages(plain):
    stack = plain
    before = reference(stack.router.url)
    rng = random.Random(0)
    timeouts = [rng.uniform(0.005, 0.6) for _ in range(1000)]
    with cf.ThreadPoolExecutor(48) as pool:
        futures = [
            pool.submit(request, stack.router.url, i, t, rng.choice([5, 40, 120]), 20) for i, t in enumerate(timeouts)
        ]
        results = [f.result(timeout=scaled(120)) for f in futures]
    assert len(results) == 1000
    assert {r[0] for r in results} <= {"ok", "error", "timeout"}
    assert sum(r[0] == "timeout" for r in results) > 100  # most were cut off by the client
    assert_clean(stack.prefill.url, stack.decode.url)
    assert request(stack.router.url, 3000)[0] == "ok"
    assert reference(stack.router.url) == before


@pytest.fixture(scope="module")
def streaming(tiny_model, tmp_path_factory):
    """A stack whose prefill streams prompts of 40+ tokens layer group by layer group, and stalls a streamed
    forward after its second group while the returned file does not exist (it does until a test removes it)."""
    release = tmp_path_factory.mktemp("stall") / "release"
    release.touch()
    s = PDStack(tiny_model, *FLAGS, prefill_flags=LAYERWISE, env=stall_env(release)).wait_healthy()
    yield s, release
    s.stop()


@pytest.fixture(scope="module")
def mono(tiny_model):
    p = serve(tiny_model, *FLAGS).wait_healthy()
    yield p
    p.stop()


def interrupt_between_groups(stack: PDStack, release: Path, kill: Callable[[], None]) -> tuple:
    """Send one streamed request (300 tokens), wait until prefill stalls it between its layer groups, `kill`, let
    the forward go on, and return the request's outcome."""
    seen = stalls(stack.prefill)
    release.unlink()
    with cf.ThreadPoolExecutor(1) as pool:
        interrupted = pool.submit(request, stack.router.url, 77)
        wait_until(lambda: stalls(stack.prefill) > seen, timeout=30, interval=0.05, what="a stream stalled mid-groups")
        kill()
        release.touch()
        return interrupted.result(timeout=CLIENT_TIMEOUT + scaled(10))


def assert_equal_monolithic(stack: PDStack, mono: Proc) -> None:
    prompts = varied_prompts(12)  # most of 40+ tokens: streamed
    expected = [generate(mono.url, p) for p in prompts]
    with cf.ThreadPoolExecutor(6) as pool:
        assert list(pool.map(lambda p: generate(stack.router.url, p), prompts)) == expected


def test_kill_decode_between_the_layer_groups_of_a_streamed_request(streaming, mono):
    stack, release = streaming
    outcome = interrupt_between_groups(stack, release, stack.decode.kill)
    assert outcome[0] == "error" and outcome[1] >= 500 and outcome[2], outcome
    assert_clean(stack.prefill.url)  # the pages of the groups sent and of those never sent all came back
    stack.decode = stack.start_decode(stack.decode.port).wait_healthy()
    wait_router_healthy(stack)
    assert_equal_monolithic(stack, mono)
    assert_clean(stack.prefill.url, stack.decode.url)


def test_kill_prefill_mid_forward_between_the_layer_groups_of_a_streamed_request(streaming, mono):
    stack, release = streaming
    outcome = interrupt_between_groups(stack, release, stack.prefill.kill)
    assert outcome[0] == "error" and outcome[1] >= 500 and outcome[2], outcome
    # Decode failed the room whose first groups landed and gave its pages back (at once or after quarantine), with
    # no prefill to tell it so.
    assert_clean(stack.decode.url)
    stack.prefill = stack.start_prefill(stack.prefill.port).wait_healthy()
    wait_router_healthy(stack)
    wait_until(
        lambda: request(stack.router.url, 1000)[0] == "ok",
        timeout=60,
        interval=1,
        what="a request through the restarted prefill",
    )
    assert_equal_monolithic(stack, mono)
    assert_clean(stack.prefill.url, stack.decode.url)
