"""Process life cycle as a client and an orchestrator see it: a scheduler process that dies, and the
graceful drain on SIGTERM of a prefill, a decode and a router instance (signalled alone, as
Kubernetes signals a container's first process).

Each drain test waits until the instance holds the requests the drain must finish, signals it, and
checks that: /health turns 503 "draining" at once; a new request gets 503 while the instance still
drains; every held stream ends with its tokens and [DONE], no error event; the process exits 0 and
logs the drain. Then the instance is restarted and fresh greedy requests give the answers the
stack gave before.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import time

import pytest
import requests

from tests.integration.procs import PDStack, Stream, reference, scaled, serve, wait_until
from tests.integration.test_pd import FLAGS, assert_clean

pytestmark = pytest.mark.integration
STREAMS = 16


def health(url: str) -> tuple[int, dict]:
    r = requests.get(f"{url}/health", timeout=scaled(5))
    return r.status_code, r.json()


def draining(url: str) -> bool:
    try:
        status, body = health(url)
    except requests.RequestException:
        return False
    return status == 503 and body["status"] == "draining"


def streams(url: str, n: int, max_tokens: int) -> list[Stream]:
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    return [Stream(url, "/v1/completions", {**body, "prompt": list(range(30 + i, 330 + i))}) for i in range(n)]


def assert_all_finished(held: list[Stream], max_tokens: int) -> None:
    for s in held:
        s.join(scaled(120))
        assert not s.is_alive(), "a stream did not end"
        assert not s.dropped, s.dropped
        assert s.status == 200 and s.done and not s.error_events, (s.error_events, s.events[-2:])
        assert s.usage.get("completion_tokens") == max_tokens, s.usage


def assert_finished_or_refused(streams: list[Stream], max_tokens: int) -> int:
    """Each stream either finished with all its tokens or was refused before its first byte with 503 and
    Retry-After (it reached the instance after the drain began); returns how many finished."""
    finished = 0
    for s in streams:
        s.join(scaled(120))
        assert not s.is_alive(), "a stream did not end"
        assert not s.dropped, s.dropped
        if s.status == 503:
            assert s.headers.get("Retry-After") and not s.events, (s.headers, s.body_text)
            continue
        assert s.status == 200 and s.done and not s.error_events, (s.status, s.body_text, s.events[-2:])
        assert s.usage.get("completion_tokens") == max_tokens, s.usage
        finished += 1
    return finished


def refused_during_drain(stack: PDStack, instance) -> requests.Response:
    """A new request through the router while `instance` drains; asserts the drain was still going on."""
    r = requests.post(f"{stack.router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30))
    assert instance.proc.poll() is None and draining(instance.url), "the drain ended before the new request"
    return r


def assert_drain_logged(instance, at_least: int) -> int:
    """The instance exited 0 and logged a drain in which every held request (at least `at_least`) finished;
    returns how many it held."""
    assert instance.wait_exit(60) == 0, instance.logs()
    logs = instance.logs()
    assert "SIGTERM: draining" in logs
    done = re.search(r"drained in [0-9.]+ s: (\d+) of (\d+) requests in flight finished, 0 cut short", logs)
    assert done and done[1] == done[2] and int(done[1]) >= at_least, logs[-2000:]
    return int(done[1])


@pytest.fixture()
def mono(tiny_model):
    p = serve(tiny_model, "--page-size", "4").wait_healthy()
    yield p
    p.stop()


def test_a_killed_scheduler_fails_every_waiting_request_with_500_instance_failed_within_2s(mono):
    """The requests it held end with a 500 coded instance_failed (one of them may have killed it: a router does not
    retry them elsewhere); new ones get a 503 (retryable: another instance may serve them)."""
    wait_until(lambda: requests.get(f"{mono.url}/stats", timeout=scaled(5)).ok, what="the first scheduler report")
    pid = requests.get(f"{mono.url}/stats", timeout=scaled(5)).json()["pid"]
    body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
    with cf.ThreadPoolExecutor(4) as pool:
        waiting = [
            pool.submit(requests.post, f"{mono.url}/v1/completions", json=body, timeout=scaled(60)) for _ in range(4)
        ]
        stream = Stream(mono.url, "/v1/completions", body)
        wait_until(
            lambda: requests.get(f"{mono.url}/stats", timeout=scaled(5)).json()["running"] == 5,
            interval=0.05,
            what="all five requests running",
        )
        assert stream.started.wait(scaled(30)), "the stream produced no token"
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        answers = [f.result(timeout=scaled(30)) for f in waiting]
        answered = time.monotonic()
        stream.join(scaled(30))
    assert [a.status_code for a in answers] == [500] * 4
    assert all("scheduler process exited" in a.json()["error"]["message"] for a in answers)
    assert all(a.json()["error"]["code"] == "instance_failed" for a in answers)
    bound = scaled(2.0)
    assert answered - killed < bound, f"the waiting requests were failed {answered - killed:.2f} s after the kill"
    assert stream.done and len(stream.error_events) == 1 and stream.ended_at - killed < bound
    status, h = health(mono.url)
    assert status == 503 and "scheduler process exited" in h["reason"]
    again = requests.post(f"{mono.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(10))
    assert again.status_code == 503


def test_drain_timeout_cuts_what_is_held_with_a_clear_error(tiny_model):
    p = serve(tiny_model, "--page-size", "4", "--drain-timeout", "1").wait_healthy()
    try:
        held = streams(p.url, 2, 3000)
        for s in held:
            assert s.started.wait(scaled(60)), "a stream produced no token"
        p.signal(signal.SIGTERM)
        for s in held:
            s.join(scaled(30))
            assert s.done and len(s.error_events) == 1, s.events[-3:]
            assert "drain timeout of 1 s expired" in s.error_events[0]["error"]["message"]
        assert p.wait_exit(30) == 0
        assert "2 cut short" in p.logs()
    finally:
        p.stop()


@pytest.fixture()
def stack(tiny_model):
    # Decode runs 2 requests at a time: prefill holds the rest in its bootstrap queue until decode
    # takes them, 8 held requests are 4 rounds of PREFILL_TOKENS steps from done, and prefill's drain
    # may take as long as decode needs. The tiny model decodes ~800 steps a second here: a round of
    # PREFILL_TOKENS steps must outlast the spread of the 16 requests' arrivals on a loaded machine
    # (over a second under stress-ng), or prefill never holds 8 at once.
    slow = ("--bootstrap-timeout", "120", "--drain-timeout", "120")
    s = PDStack(tiny_model, *FLAGS, decode_flags=("--max-running-requests", "2"), prefill_flags=slow).wait_healthy()
    yield s
    s.stop()


PREFILL_TOKENS = 400


def test_sigterm_to_prefill_finishes_every_handoff(stack):
    """Every request prefill held when the signal went out finishes; one that had not reached prefill by then
    is refused with 503 and Retry-After, never anything else."""
    before = reference(stack.router.url)
    held = streams(stack.router.url, STREAMS, PREFILL_TOKENS)

    def holding() -> int:
        q = requests.get(f"{stack.prefill.url}/stats", timeout=scaled(5)).json()["queues"]
        count = q["prefill_bootstrap"] + q["prefill_forward"] + q["prefill_inflight"]
        return count if count >= 8 else 0

    observed = wait_until(holding, interval=0.05, what="prefill holding requests in its handoff stages")
    stack.prefill.signal(signal.SIGTERM)
    wait_until(lambda: draining(stack.prefill.url), timeout=5, interval=0.05, what="prefill /health draining")
    r = refused_during_drain(stack, stack.prefill)
    assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
    finished = assert_finished_or_refused(held, PREFILL_TOKENS)
    # The requests seen in prefill's stages before the signal were admitted: each one finished.
    assert finished >= observed, f"{finished} streams finished, but prefill held {observed} at the signal"
    in_flight = assert_drain_logged(stack.prefill, at_least=1)
    assert in_flight <= finished, f"the drain logged {in_flight} requests finished, the clients saw {finished}"
    stack.prefill = stack.start_prefill(stack.prefill.port).wait_healthy()
    wait_until(lambda: health(stack.router.url)[0] == 200, what="router healthy again")
    assert reference(stack.router.url) == before
    assert_clean(stack.prefill.url, stack.decode.url)


def test_sigterm_to_decode_finishes_every_stream(tiny_model):
    # The drain may take as long as the streams need on a loaded machine.
    stack = PDStack(tiny_model, *FLAGS, decode_flags=("--drain-timeout", "120")).wait_healthy()
    try:
        before = reference(stack.router.url)
        held = streams(stack.router.url, STREAMS, 300)
        for s in held:
            assert s.started.wait(scaled(60)), "a stream produced no token"
        stack.decode.signal(signal.SIGTERM)
        wait_until(lambda: draining(stack.decode.url), timeout=5, interval=0.05, what="decode /health draining")
        r = refused_during_drain(stack, stack.decode)
        assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
        assert_all_finished(held, 300)
        # Every stream had produced a token when the signal came and ends with all its tokens; how many decode
        # still held is its own count (a client's count of received tokens lags what decode produced).
        assert_drain_logged(stack.decode, at_least=1)
        stack.decode = stack.start_decode(stack.decode.port).wait_healthy()
        wait_until(lambda: health(stack.router.url)[0] == 200, what="router healthy again")
        assert reference(stack.router.url) == before
        assert_clean(stack.prefill.url, stack.decode.url)
    finally:
        stack.stop()


def test_sigterm_to_the_router_finishes_its_open_streams(tiny_model):
    stack = PDStack(tiny_model, *FLAGS, router_flags=("--drain-timeout", "120")).wait_healthy()
    try:
        held = streams(stack.router.url, 4, 600)
        for s in held:
            assert s.started.wait(scaled(60)), "a stream produced no token"
        stack.router.signal(signal.SIGTERM)
        wait_until(lambda: draining(stack.router.url), timeout=5, interval=0.05, what="router /health draining")
        # The readiness probe fails too, so the pod leaves its Service while it finishes what it holds.
        ready = requests.get(f"{stack.router.url}/ready", timeout=scaled(5))
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        r = requests.post(
            f"{stack.router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30)
        )
        assert stack.router.proc.poll() is None, "the router exited before the new request"
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert_all_finished(held, 600)
        assert_drain_logged(stack.router, at_least=1)
        assert_clean(stack.prefill.url, stack.decode.url)
    finally:
        stack.stop()


def test_scaling_decode_down_loses_no_stream(tiny_model):
    """Two decode instances; the one a StatefulSet scale-down removes (the last) gets SIGTERM the way the kubelet
    sends it, while both stream. Every stream on either ends with its tokens and [DONE], and requests that arrive
    during the drain are served by the other decode: the client never sees an error."""
    stack = PDStack(tiny_model, *FLAGS, decodes=2, decode_flags=("--drain-timeout", "120")).wait_healthy()
    try:
        leaving = stack.decodes[1]
        wait_until(lambda: all(p["verified"] for p in health(stack.router.url)[1]["pairs"]), what="both pairs")
        held = streams(stack.router.url, STREAMS, 300)
        for s in held:
            assert s.started.wait(scaled(60)), "a stream produced no token"
        wait_until(  # /stats reports every 0.5 s
            lambda: requests.get(f"{leaving.url}/stats", timeout=scaled(5)).json()["running"],
            timeout=10,
            interval=0.1,
            what="the leaving decode holding streams",
        )
        leaving.signal(signal.SIGTERM)
        wait_until(lambda: draining(leaving.url), timeout=5, interval=0.05, what="the leaving decode draining")
        wait_until(
            lambda: not next(w for w in health(stack.router.url)[1]["workers"] if w["url"] == leaving.url)["healthy"],
            timeout=5,
            interval=0.1,
            what="the router dropping the leaving decode",
        )
        during = [
            requests.post(
                f"{stack.router.url}/v1/completions", json={"prompt": [7, 8, i], "max_tokens": 4}, timeout=scaled(60)
            )
            for i in range(4)
        ]
        assert leaving.proc.poll() is None, "the drain ended before the new requests"
        assert [r.status_code for r in during] == [200] * 4, [r.text[:200] for r in during]
        assert_all_finished(held, 300)
        # The report that showed streams running is up to 0.5 s old: that they were still there at the signal is
        # what the log says, and every stream finishing is the guarantee.
        assert_drain_logged(leaving, at_least=1)
        assert_clean(stack.prefill.url, stack.decodes[0].url)
    finally:
        stack.stop()
