"""Bounded load and bad input at a worker's HTTP front end, as a client meets them: real processes.

The server here holds at most 2 requests (--max-inflight-requests 2) and serves a 262144-token
context, so its body limit is 32 * 262144 + 1 MiB = 9 MiB: a multi-megabyte prompt is read and
tokenised (then refused as too long for the context), which is what /health must survive.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import socket
import time

import pytest
import requests

from tests.integration.procs import scaled, serve, sse_stream, wait_until

pytestmark = pytest.mark.integration
CONTEXT = 262144
BODY_LIMIT = 32 * CONTEXT + (1 << 20)


@pytest.fixture(scope="module")
def bounded(tiny_model):
    p = serve(
        tiny_model,
        *("--max-inflight-requests", "2", "--max-context-len", str(CONTEXT), "--max-total-tokens", "8192"),
        *("--log-level", "debug"),  # what a client's leaving logs (test_a_client_leaving_mid_body_is_no_error)
    ).wait_healthy()
    yield p
    p.stop()


def announce(port: int, length: int, path: str = "/v1/completions") -> tuple[int, str]:
    """Send only the headers of a body of `length` bytes; the status line and body of the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=scaled(10)) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        s.sendall(head.encode())
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def test_an_oversize_body_is_413_before_it_is_read(bounded):
    status, body = announce(bounded.port, BODY_LIMIT + 1)
    assert status == 413 and "request_too_large" in body and str(BODY_LIMIT) in body
    assert announce(bounded.port, 10**12)[0] == 413
    # The model's own /v1/models says the context the limit follows.
    assert requests.get(f"{bounded.url}/v1/models", timeout=scaled(5)).json()["data"][0]["max_model_len"] == CONTEXT


def test_requests_over_the_inflight_bound_get_429(bounded):
    body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    held = [sse_stream(bounded.url, "/v1/completions", body) for _ in range(2)]
    try:
        for r, events in held:
            assert r.status_code == 200
            assert next(events)["choices"], "each held request has streamed a token"
        refused = requests.post(
            f"{bounded.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30)
        )
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        err = refused.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "2 requests" in err["message"]
        health = requests.get(f"{bounded.url}/health", timeout=scaled(5))
        assert health.status_code == 200, "a full server is still healthy"
    finally:
        for r, _ in held:
            r.close()
    wait_until(
        lambda: (
            requests.post(
                f"{bounded.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30)
            ).ok
        ),
        timeout=30,
        what="admitted again once the held requests left",
    )


def test_health_answers_while_a_huge_prompt_is_tokenized(bounded):
    rng = random.Random(0)
    words = ["once", "upon", "a", "time", "the", "sea", "quantum", "zebra", "harbour", "lantern"]
    prompt = " ".join(rng.choice(words) for _ in range(800_000))  # ~4.5 MB, under the 9 MiB limit
    assert 4_000_000 < len(prompt) < BODY_LIMIT - 1000
    with cf.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        big = pool.submit(
            requests.post,
            f"{bounded.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1},
            timeout=scaled(120),
        )
        latencies = []
        while not big.done():
            t = time.monotonic()
            assert requests.get(f"{bounded.url}/health", timeout=scaled(10)).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.05)
        took = time.monotonic() - start
    r = big.result()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    assert took > 1.0, f"the prompt took {took:.2f} s: too quick to show a stalled loop"
    assert len(latencies) >= 10
    # A stalled loop makes one probe wait about as long as the whole request; on a loaded machine
    # any probe may wait a scheduling slice or two, and longer the more loaded it is.
    bound = min(scaled(1.0), took / 4)
    assert max(latencies) < bound, f"/health waited {max(latencies):.2f} s of the prompt's {took:.2f} s"


def test_a_stop_string_over_the_length_cap_is_400(bounded):
    r = requests.post(
        f"{bounded.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "stop": ["x" * 1025]},
        timeout=scaled(30),
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stop" and "1024 characters" in r.json()["error"]["message"]


def test_a_client_leaving_mid_body_is_no_error(bounded):
    """A client that closes its connection while its body is read is logged at debug level under its request
    id, with no traceback; the server goes on serving."""
    for i in range(3):
        with socket.create_connection(("127.0.0.1", bounded.port), timeout=scaled(10)) as s:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-{i}\r\nContent-Length: 100\r\n\r\n"
            s.sendall(head.encode() + b'{"prompt": ')
    for i in range(3):
        line = f"request gone-{i} (POST /v1/completions): the client left before its answer"
        wait_until(lambda: line in bounded.logs(), 30, what=f"gone-{i}'s leaving logged")  # noqa: B023
    r = requests.post(f"{bounded.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(60))
    assert r.status_code == 200
    assert "Error handling request" not in bounded.logs() and "ConnectionResetError" not in bounded.logs()
