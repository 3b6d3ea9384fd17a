"""What a caller of the router learns while no prefill/decode pair serves: `/ready`, an open path, says only that
the router is not ready unless the caller may see /health's details (an API key holder, the operator's token);
a client's request gets a 503 that names no worker. The workers' names and addresses go to the log."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer

from disagg_worker import keys
from disagg_worker.http.admission import Admission
from disagg_worker.http.auth import require_keys
from disagg_worker.router.app import NO_PAIR, Router
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.server import build_router_app
from disagg_worker.router.verify import PairVerifier
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool

KEY = "client-key"
OPERATOR = keys.derive("the-secret", keys.HEALTH)
# What no open answer may show: the workers' pod names and addresses.
INTERNAL = ("m-prefill-0", "m-decode-0", "10.1.2.")


def router(verified: bool) -> Router:
    """A router whose decode is down: with verification, its pair known and failing; without, no pair healthy."""
    prefill = Worker("http://10.1.2.3:8000", "prefill", 8998, healthy=True, report={"pod": "m-prefill-0"})
    decode = Worker("http://10.1.2.4:8000", "decode", report={"pod": "m-decode-0"})
    pool = WorkerPool(static=[prefill, decode])
    auth = RouterAuth(api_keys=(KEY,), health_token=OPERATOR)
    verifier = PairVerifier(pool, auth=auth) if verified else None
    if verifier is not None:
        verifier.refresh()
    return Router(pool, "m", verifier=verifier, auth=auth)


async def answers(r: Router, calls: list[tuple[str, str, str]]) -> list[tuple[int, dict, str]]:
    app = build_router_app(r, Admission(8, r.body_limit))
    require_keys(app, r.auth.api_keys)
    out = []
    async with TestClient(TestServer(app)) as client:
        for method, path, key in calls:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"prompt": "hi", "max_tokens": 2} if method == "POST" else None
            resp = await client.request(method, path, json=body, headers=headers)
            out.append((resp.status, await resp.json(), resp.headers.get("Retry-After", "")))
    return out


@pytest.mark.parametrize("verified", [True, False])
def test_an_unready_router_tells_a_probe_only_that_it_is_not_ready(verified, caplog):
    caplog.set_level(logging.WARNING)
    (status, body, _), *detailed = asyncio.run(
        answers(router(verified), [("GET", "/ready", ""), ("GET", "/ready", KEY), ("GET", "/ready", OPERATOR)])
    )
    assert status == 503 and body == {"status": "unhealthy", "reason": NO_PAIR}
    for status, body, _ in detailed:
        assert status == 503 and body["status"] == "unhealthy"
        if verified:  # the verifier's reason: which pair does not serve, and why
            assert body["reason"] == f"{NO_PAIR} (m-prefill-0 -> m-decode-0: decode m-decode-0 is not healthy)"
    if verified:
        assert "m-prefill-0 -> m-decode-0: decode m-decode-0 is not healthy" in caplog.text


@pytest.mark.parametrize("verified", [True, False])
def test_a_request_without_a_pair_gets_a_503_that_names_no_worker(verified):
    [(status, body, retry_after)] = asyncio.run(answers(router(verified), [("POST", "/v1/completions", KEY)]))
    assert status == 503 and retry_after == "1"
    assert body["error"]["message"] == NO_PAIR
    assert not any(name in str(body) for name in INTERNAL), body
