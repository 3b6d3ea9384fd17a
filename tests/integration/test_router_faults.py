"""What a client of the router sees when it is overloaded, sent too much, or an upstream fails.

One prefill and two decode instances (decode A and B; round-robin alternates between them), the router
bounded at 4 requests in flight with a 45 s per-request timeout and no migration (`--migration-limit 0`: a
stream whose decode fails ends). Fault tests wait until the streams they interrupt have produced tokens and
B reports them running, kill or freeze decode B, and require every stream to end with [DONE], the
interrupted ones with an error event; then B is restarted (or thawed) and fresh greedy requests must give
the answers the stack gave before. Answers are long (1000+ tokens, seconds even on a quiet machine), so B is
still producing them when the fault lands.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time

import pytest
import requests

from tests.integration.procs import PDStack, Stream, reference, scaled, sse_stream, wait_until
from tests.integration.test_limits import announce
from tests.integration.test_pd import FLAGS

pytestmark = pytest.mark.integration
# The router's per-request timeout: a product deadline a healthy answer must not meet on a loaded machine.
REQUEST_TIMEOUT_S = 45.0
REQUEST_TIMEOUT = scaled(REQUEST_TIMEOUT_S)
LONG = 1000
MAX_INFLIGHT = 4


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(
        tiny_model,
        *FLAGS,
        decodes=2,
        # Without migration (tests/integration/test_migration.py has it): a stream whose decode fails ends.
        router_flags=(
            "--max-inflight",
            str(MAX_INFLIGHT),
            "--request-timeout",
            f"{REQUEST_TIMEOUT:g}",
            "--migration-limit",
            "0",
        ),
    ).wait_healthy()
    every_pair_verified(s)
    s.before = reference(s.router.url)
    yield s
    s.stop()


def every_pair_verified(stack: PDStack) -> None:
    """The router sees every worker healthy and has verified both prefill->decode pairs (it sends requests only
    through verified pairs, so a test that needs both decodes busy waits for this)."""

    def verified() -> bool:
        health = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()
        pairs = health.get("pairs", [])
        return all(w["healthy"] for w in health["workers"]) and len(pairs) == 2 and all(p["verified"] for p in pairs)

    wait_until(verified, what="the router has verified both pairs")


def revive_b(stack: PDStack) -> None:
    """Decode B is back and the router picks it again; fresh answers are what they were."""
    b = stack.decodes[1]
    if b.proc.poll() is not None:
        stack.decodes[1] = b = stack.start_decode(b.port)
    b.wait_healthy()
    every_pair_verified(stack)
    assert reference(stack.router.url) == stack.before


def running(url: str) -> int:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()["running"]


def test_an_oversize_body_gets_413_from_the_router(stack):
    model = requests.get(f"{stack.router.url}/v1/models", timeout=scaled(5)).json()["data"][0]
    limit = 32 * model["max_model_len"] + (1 << 20)  # learned from the workers' /v1/models
    status, body = announce(stack.router.port, limit + 1)
    assert status == 413 and "request_too_large" in body
    ok = requests.post(f"{stack.router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30))
    assert ok.status_code == 200


def test_requests_over_the_routers_bound_get_429(stack):
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    held = [sse_stream(stack.router.url, "/v1/completions", body) for _ in range(MAX_INFLIGHT)]
    try:
        for r, events in held:
            assert r.status_code == 200 and next(events)["choices"]
        refused = requests.post(
            f"{stack.router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30)
        )
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for r, _ in held:
            r.close()
    wait_until(
        lambda: (
            requests.post(
                f"{stack.router.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30)
            ).ok
        ),
        timeout=30,
        what="admitted again",
    )


def test_a_decode_killed_mid_stream_ends_its_streams_with_an_error_event(stack):
    body = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    held = [Stream(stack.router.url, "/v1/completions", {**body, "prompt": f"story {i}"}) for i in range(MAX_INFLIGHT)]
    for s in held:
        assert s.started.wait(scaled(60)), "a stream produced no token"
    wait_until(lambda: all(running(d.url) >= 1 for d in stack.decodes), interval=0.05, what="both decodes streaming")
    stack.decodes[1].kill()
    for s in held:
        s.join(REQUEST_TIMEOUT + scaled(10))
        assert not s.is_alive() and not s.dropped, s.dropped
        assert s.status == 200 and s.done, s.events[-2:]
    for s in held:  # finished, or ended by exactly one error event
        assert len(s.error_events) == 1 or s.events[-2]["choices"][0]["finish_reason"] == "length", s.events[-2:]
    cut = [s for s in held if s.error_events and "closed the connection" in s.error_events[0]["error"]["message"]]
    assert 1 <= len(cut) < len(held), "the streams on the killed decode, and only those, lost their connection"
    revive_b(stack)


class ChoiceStream(threading.Thread):
    """An n = 4 stream: the choices that have produced a token, those that finished, the error events."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.seen: set[int] = set()
        self.finished: set[int] = set()
        self.errors: list[str] = []
        self.done = False
        self.all_started = threading.Event()
        self.start()

    def run(self) -> None:
        r, events = sse_stream(self.url, "/v1/completions", self.body, timeout=REQUEST_TIMEOUT_S + 30)  # scaled there
        for e in events:
            if e == "[DONE]":
                self.done = True
            elif "error" in e:
                self.errors.append(e["error"]["message"])
            else:
                for c in e["choices"]:
                    self.seen.add(c["index"])
                    if c["finish_reason"]:
                        self.finished.add(c["index"])
            if len(self.seen) == 4:
                self.all_started.set()
        self.all_started.set()


def n4(stack: PDStack, max_tokens: int = LONG) -> ChoiceStream:
    body = {"prompt": "The sea", "n": 4, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": 3}
    s = ChoiceStream(stack.router.url, body)
    assert s.all_started.wait(scaled(60)) and len(s.seen) == 4, "every choice has produced a token"
    wait_until(lambda: all(running(d.url) >= 1 for d in stack.decodes), interval=0.05, what="both decodes streaming")
    return s


def test_an_n4_stream_with_one_upstream_killed_ends_with_an_error_for_its_choices(stack):
    s = n4(stack)
    killed = time.monotonic()
    stack.decodes[1].kill()
    s.join(REQUEST_TIMEOUT + scaled(10))
    assert not s.is_alive() and s.done
    assert time.monotonic() - killed < REQUEST_TIMEOUT
    assert len([e for e in s.errors if "closed the connection" in e]) == 2, s.errors
    assert len(s.finished) + len(s.errors) == 4, "the choices on the live decode finished (or met the timeout)"
    revive_b(stack)


def test_an_n4_stream_with_one_upstream_hung_ends_within_the_request_timeout(stack):
    # B's choices cannot finish (frozen); A's 3000 tokens may finish or meet the timeout on a loaded machine.
    s = n4(stack, 3000)
    frozen = time.monotonic()
    b = stack.decodes[1]
    os.killpg(b.proc.pid, signal.SIGSTOP)
    try:
        s.join(REQUEST_TIMEOUT + scaled(10))
        ended = time.monotonic()
    finally:
        os.killpg(b.proc.pid, signal.SIGCONT)
    assert not s.is_alive() and s.done
    assert ended - frozen < REQUEST_TIMEOUT + scaled(2), f"the stream ended {ended - frozen:.1f} s after the freeze"
    timed_out = [e for e in s.errors if "request timeout" in e]
    assert len(timed_out) >= 2 and len(timed_out) == len(s.errors), s.errors
    assert len(s.finished) + len(s.errors) == 4, "every choice finished or ended with its error"
    revive_b(stack)


def test_a_whole_answer_whose_decode_dies_is_retried_on_the_other(stack):
    prompts = [list(range(100 + 13 * i, 160 + 13 * i)) for i in range(2)]
    body = {"sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}
    with cf.ThreadPoolExecutor(2) as pool:
        answers = [
            pool.submit(
                requests.post, f"{stack.router.url}/generate", json={**body, "input_ids": p}, timeout=scaled(120)
            )
            for p in prompts
        ]
        wait_until(lambda: all(running(d.url) >= 1 for d in stack.decodes), interval=0.05, what="both decodes busy")
        stack.decodes[1].kill()
        results = [a.result(timeout=scaled(120)) for a in answers]
    assert [r.status_code for r in results] == [200, 200], [r.text[:200] for r in results]
    b_url = stack.decodes[1].url
    assert f"decode {b_url} failed before answering" in stack.router.logs(), "the kill interrupted B's answer"
    revive_b(stack)
    for p, r in zip(prompts, results, strict=True):
        fresh = requests.post(f"{stack.router.url}/generate", json={**body, "input_ids": p}, timeout=scaled(120))
        assert r.json()["output_ids"] == fresh.json()["output_ids"], "the retried answer is the greedy one"
