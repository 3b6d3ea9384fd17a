"""API keys on the two endpoints a client talks to: the monolithic server and `serve --local`'s router (whose
workers are reached with the stack's own secret, so the client's key works only at the router)."""

from __future__ import annotations

import pytest
import requests

from tests.integration.procs import Proc, free_port, scaled, serve

pytestmark = pytest.mark.integration
BODY = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def assert_unauthorized(r: requests.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["message"]


def test_the_monolithic_server_wants_a_key_everywhere_but_health(tiny_model, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("k-one\nk-two\n")
    mono = serve(tiny_model, "--api-key-file", str(keys)).wait_healthy()
    try:
        url = mono.url
        for headers in ({}, {"Authorization": "Bearer k-three"}, {"Authorization": "Basic k-one"}):
            assert_unauthorized(requests.post(f"{url}/v1/completions", json=BODY, headers=headers, timeout=scaled(30)))
            for path in ("/v1/models", "/metrics", "/stats"):
                assert_unauthorized(requests.get(f"{url}{path}", headers=headers, timeout=scaled(30)))
            assert_unauthorized(requests.post(f"{url}/flush_cache", headers=headers, timeout=scaled(30)))
        assert requests.get(f"{url}/health", timeout=scaled(30)).status_code == 200
        for key in ("k-one", "k-two"):
            auth = {"Authorization": f"Bearer {key}"}
            r = requests.post(f"{url}/v1/completions", json=BODY, headers=auth, timeout=scaled(60))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            assert requests.get(f"{url}/metrics", headers=auth, timeout=scaled(30)).status_code == 200
        # A stored response is its key's: to another key it does not exist (read, continued or deleted).
        a, b = ({"Authorization": f"Bearer {key}"} for key in ("k-one", "k-two"))
        made = requests.post(
            f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 4}, headers=a, timeout=scaled(60)
        )
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        assert requests.get(f"{url}/v1/responses/{rid}", headers=b, timeout=scaled(30)).status_code == 404
        follow = {"input": "more", "previous_response_id": rid, "max_output_tokens": 4}
        r = requests.post(f"{url}/v1/responses", json=follow, headers=b, timeout=scaled(60))
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
        assert requests.delete(f"{url}/v1/responses/{rid}", headers=b, timeout=scaled(30)).status_code == 404
        assert requests.get(f"{url}/v1/responses/{rid}", headers=a, timeout=scaled(30)).json()["id"] == rid
        assert requests.post(f"{url}/v1/responses", json=follow, headers=a, timeout=scaled(60)).status_code == 200
    finally:
        mono.stop()


def test_serve_local_puts_the_key_on_its_router(tiny_model):
    port = free_port()
    stack = Proc(["serve", "--local", "--model", tiny_model, "--port", str(port), "--api-key", "local-key"], port)
    try:
        stack.wait_healthy()
        assert_unauthorized(requests.post(f"{stack.url}/v1/completions", json=BODY, timeout=scaled(30)))
        # The kubelet's probes carry no key: the router's readiness and liveness paths answer without one.
        for path in ("/ready", "/livez"):
            r = requests.get(f"{stack.url}{path}", timeout=scaled(30))
            assert r.status_code == 200 and r.json()["status"] in ("ok", "alive"), (path, r.text)
        auth = {"Authorization": "Bearer local-key"}
        r = requests.post(f"{stack.url}/v1/completions", json=BODY, headers=auth, timeout=scaled(60))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        # /health answers anyone, but lists the workers (their addresses, pod names, errors) only to a key holder.
        plain = requests.get(f"{stack.url}/health", timeout=scaled(30))
        assert plain.status_code == 200 and plain.json() == {"status": "ok"}, plain.text
        detailed = requests.get(f"{stack.url}/health", headers=auth, timeout=scaled(30)).json()
        assert detailed["status"] == "ok" and {w["role"] for w in detailed["workers"]} == {"prefill", "decode"}
    finally:
        stack.stop()
