"""API keys on an HTTP app (the router's and every engine instance's): 401 in OpenAI's shape without a right
key, /health open, everything else, metrics and admin routes included, closed."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from disagg_worker.http.auth import auth_middleware, require_keys

UNAUTHORIZED = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


def app_with_keys(keys: tuple[str, ...]) -> web.Application:
    app = web.Application()

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path})

    for path in ("/health", "/metrics", "/stats", "/v1/models"):
        app.router.add_get(path, ok)
    app.router.add_post("/flush_cache", ok)
    require_keys(app, keys)
    return app


async def calls(app: web.Application, requests: list[tuple[str, str, dict]]) -> list[tuple[int, dict]]:
    async with TestClient(TestServer(app)) as client:
        out = []
        for method, path, headers in requests:
            r = await client.request(method, path, headers=headers)
            out.append((r.status, await r.json() if r.content_type == "application/json" else {}))
        return out


def test_a_right_key_passes_a_missing_or_wrong_one_gets_openais_401_and_health_stays_open():
    good, other = {"Authorization": "Bearer k2"}, {"Authorization": "Bearer k1x"}
    requests: list[tuple[str, str, dict]] = [("GET", "/health", {})]
    for path, method in [("/metrics", "GET"), ("/stats", "GET"), ("/v1/models", "GET"), ("/flush_cache", "POST")]:
        requests += [(method, path, {}), (method, path, other), (method, path, {"Authorization": "k2"})]
        requests += [(method, path, {"Authorization": "Basic k2"}), (method, path, good)]
    got = asyncio.run(calls(app_with_keys(("k1", "k2")), requests))
    assert got[0] == (200, {"path": "/health"})
    for i in range(1, len(got), 5):
        path = requests[i][1]
        for status, body in got[i : i + 4]:
            assert status == 401, path
            assert set(body) == {"error"} and {k: body["error"][k] for k in UNAUTHORIZED} == UNAUTHORIZED
            assert body["error"]["message"]
        assert got[i + 4] == (200, {"path": path})


def test_unknown_paths_are_refused_before_anything_says_they_do_not_exist():
    got = asyncio.run(
        calls(app_with_keys(("k",)), [("GET", "/nope", {}), ("GET", "/nope", {"Authorization": "Bearer k"})])
    )
    assert [status for status, _ in got] == [401, 404]


def test_no_keys_changes_nothing_and_an_empty_key_is_never_accepted():
    assert asyncio.run(calls(app_with_keys(()), [("GET", "/metrics", {})]))[0][0] == 200
    for keys in [("",), ("k", "")]:
        with pytest.raises(ValueError):
            auth_middleware(keys)


def test_the_routers_health_details_are_for_key_holders_and_the_operator():
    from disagg_operator.probe_auth import health_token
    from disagg_worker import keys
    from disagg_worker.router.auth import RouterAuth

    operator_token = health_token("the-secret")
    assert operator_token == keys.derive("the-secret", keys.HEALTH)  # the operator derives what the router accepts
    auth = RouterAuth(api_keys=("client-key",), health_token=keys.derive("the-secret", keys.HEALTH))
    assert auth.shows_health_details("Bearer client-key")
    assert auth.shows_health_details(f"Bearer {operator_token}")
    assert not auth.shows_health_details("")
    assert not auth.shows_health_details(f"Bearer {keys.derive('the-secret', keys.WORKER)}")
    assert RouterAuth().shows_health_details("")  # without API keys, /health is as open as it always was


def test_the_operator_reads_each_models_secret_once_for_its_probe_token():
    import base64

    from disagg_operator.probe_auth import ProbeTokens, health_token
    from tests.unit.test_operator_status import CR

    reads = []

    class Kube:
        def get(self, api_version, kind, namespace, name):
            reads.append((namespace, name))
            return {"data": {"token": base64.b64encode(b"s3cret\n").decode()}} if name == "m-auth" else None

    tokens = ProbeTokens(Kube())
    assert tokens.for_crs({"u1": CR}) == {"u1": health_token("s3cret")}
    assert tokens.for_crs({"u1": CR}) == {"u1": health_token("s3cret")}
    assert reads == [(CR["metadata"]["namespace"], "m-auth")]
