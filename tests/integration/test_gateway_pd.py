"""P/D through a Gateway API gateway's data plane: a real Envoy (`gateway.py`: ext_proc filter, ORIGINAL_DST cluster
on `x-gateway-destination-endpoint`) in front of `disagg epp` in P/D mode, two prefill and two decode instances of
the tiny model (Mooncake TCP), and a monolithic server for reference. The picker picks a decode for each request
and a prefill with it, named in `x-prefiller-host-port`; the decode runs the prefill leg itself
(`router/decode_handoff.py`).

The prefills listen on 127.0.0.1 and 127.0.0.2 and share one bootstrap port, as pods of a Deployment share theirs
(a decode's hand-off knows one bootstrap port for every prefill, `--bootstrap-port`).

The official client through Envoy gets the greedy answers monolithic gives (chat and completions, whole and
streamed; streams end with [DONE]), the prefills computed the prompts and the decodes received their KV; a repeated
long prefix goes to the prefill holding it; the subset hint bounds the decodes; a client's own
`x-prefiller-host-port` is not the one followed; no prefill ready is a 503 naming it."""

from __future__ import annotations

import openai
import pytest
import requests

from tests.integration.gateway import SERVED, Envoy, envoy_config, health_status, start_epp
from tests.integration.procs import FAST_FAILURE, Proc, free_port, scaled, serve, wait_until
from tests.integration.test_gateway import body, headers, immediate, index_pages, wait_ready
from tests.integration.test_gateway_handoff import FLAGS, HEADER, answers, metric, transfers

pytestmark = pytest.mark.integration
HOSTS = ("127.0.0.1", "127.0.0.2")  # the prefills' addresses (both loopback: the decodes' default allow-list)
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story about the sea."}], "max_tokens": 4}


def addr(p: Proc) -> str:
    return p.url.removeprefix("http://")


def prefill(model: str, host: str, bootstrap_port: int) -> Proc:
    port = free_port()
    where = ["--host", host, "--advertise-host", host, "--port", str(port), "--bootstrap-port", str(bootstrap_port)]
    p = Proc(["prefill", "--model", model, *where, *FLAGS, *FAST_FAILURE], port)
    p.url = f"http://{host}:{port}"
    return p


def decode(model: str, bootstrap_port: int) -> Proc:
    port = free_port()
    allow = ("--prefill-allow", ",".join(HOSTS))  # the prefills, by address
    args = ["decode", "--model", model, "--port", str(port), "--bootstrap-port", str(bootstrap_port), *allow]
    return Proc([*args, *FLAGS, *FAST_FAILURE], port)


@pytest.fixture(scope="module")
def stack(tiny_model):
    """Prefills, decodes and the monolithic reference, started together."""
    bootstrap = free_port()
    prefills = [prefill(tiny_model, h, bootstrap) for h in HOSTS]
    decodes = [decode(tiny_model, bootstrap) for _ in range(2)]
    mono = serve(tiny_model, *FLAGS)
    everyone = [*prefills, *decodes, mono]
    try:
        for p in everyone:
            p.wait_healthy()
        yield prefills, decodes, mono
    finally:
        for p in everyone:
            p.stop()


@pytest.fixture(scope="module")
def epp(stack, tiny_model):
    prefills, decodes, _ = stack
    urls = [a for d in decodes for a in ("--endpoint", d.url)] + [a for p in prefills for a in ("--prefill", p.url)]
    p = start_epp(*urls, "--policy", "cache_aware", "--tokenizer", tiny_model, "--served-model-name", "tiny")
    wait_ready(p)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def envoy(epp, stack):
    _, decodes, _ = stack
    listeners = {name: free_port() for name in ("close", "open", "subset")}
    config = envoy_config(free_port(), listeners, epp.grpc, [d.port for d in decodes], [addr(decodes[1])])
    e = Envoy(config, listeners).wait_ready()
    yield e
    e.stop()


def client(url: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(60), default_headers=headers
    )


def total(procs: list[Proc], name: str) -> float:
    return sum(metric(p.url, name) for p in procs)


def test_greedy_answers_through_envoy_equal_monolithic_and_ran_through_pd(envoy, epp, stack):
    prefills, decodes, mono = stack
    computed, moved = total(prefills, "disagg_prompt_tokens_total"), sum(transfers(d.url) for d in decodes)
    named = metric(f"http://127.0.0.1:{epp.port}", "disagg_epp_prefill_picked_total")
    got = answers(client(envoy.url("close")))
    assert got == answers(client(mono.url)) and all(got.values()), got
    # P/D happened: a prefill was named for each request, the prefills computed the prompts, and the decodes received
    # their KV, one transfer a request (as the decodes' schedulers report every half second).
    assert metric(f"http://127.0.0.1:{epp.port}", "disagg_epp_prefill_picked_total") == named + 4
    assert total(prefills, "disagg_prompt_tokens_total") > computed
    wait_until(lambda: sum(transfers(d.url) for d in decodes) >= moved + 4, timeout=scaled(10), what="four transfers")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_through_envoy_ends_with_done(envoy, path):
    payload = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True}
    payload.update({"messages": CHAT["messages"]} if "chat" in path else {"prompt": "Once upon a time"})
    r = requests.post(f"{envoy.url('close')}{path}", json=payload, timeout=scaled(60))
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2 and '"error"' not in r.text


def finished(p: Proc) -> float:
    return metric(p.url, "disagg_requests_total")


def test_a_repeated_long_prefix_is_prefilled_where_it_is_cached(envoy, epp, stack):
    prefills, decodes, _ = stack
    prefixes = ["The ship sailed on through the storm " * 12, "Numbers climb: one two three four five six " * 12]
    # Each prefill computes one prefix first (named to a decode directly), and the picker indexes their caches.
    for p, prefix in zip(prefills, prefixes, strict=True):
        before = index_pages(epp, p)
        c = client(decodes[0].url, {HEADER: addr(p)})
        c.chat.completions.create(**{**CHAT, "messages": [{"role": "user", "content": prefix}]})
        wait_until(lambda p=p, before=before: index_pages(epp, p) > before, timeout=scaled(30), what="index grows")
    gated = client(envoy.url("close"))
    for i in range(3):
        for p, prefix in zip(prefills, prefixes, strict=True):
            (other,) = [q for q in prefills if q is not p]
            mine, theirs = finished(p), finished(other)
            gated.chat.completions.create(**{**CHAT, "messages": [{"role": "user", "content": f"{prefix} then {i}"}]})
            wait_until(lambda p=p, mine=mine: finished(p) > mine, timeout=scaled(10), what=f"{addr(p)} prefilled")
            assert finished(other) == theirs


def test_the_subset_hint_bounds_the_decodes(envoy, stack):
    _, decodes, _ = stack
    moved = transfers(decodes[1].url)
    for _ in range(4):
        r = requests.post(f"{envoy.url('subset')}/v1/chat/completions", json=CHAT, timeout=scaled(60))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        assert r.headers[SERVED] == addr(decodes[1])
    wait_until(lambda: transfers(decodes[1].url) >= moved + 4, timeout=scaled(10), what="the decode's transfers")


def test_a_clients_own_prefill_header_is_not_the_one_followed(envoy, stack):
    _, _, mono = stack
    kw = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there: a decode sent there would answer 502
    got = client(envoy.url("close"), {HEADER: nobody}).completions.create(**kw)
    assert got.choices[0].text == client(mono.url).completions.create(**kw).choices[0].text


def scrape(p: Proc) -> str:
    return requests.get(f"http://127.0.0.1:{p.port}/metrics", timeout=scaled(5)).text


def test_no_prefill_ready_is_a_503_naming_it_and_not_ready_in_health(stack):
    _, decodes, _ = stack
    nobody = f"http://127.0.0.1:{free_port()}"  # the one prefill: nothing listens there
    p = start_epp("--endpoint", decodes[0].url, "--prefill", nobody, "--served-model-name", "tiny")
    try:
        wait_until(lambda: health_status(p.health, "liveness") == "SERVING", timeout=scaled(60), what="epp alive")
        # Once the picker has seen the decode healthy, it is still not ready: no prefill is.
        seen = f'disagg_router_worker_healthy{{role="decode",worker="{decodes[0].url}"}} 1.0'
        wait_until(lambda: seen in scrape(p), timeout=scaled(60), what="the decode seen healthy")
        assert health_status(p.health, "readiness") == "NOT_SERVING"
        raw = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 2}'
        code, err = immediate(p.grpc, headers("/v1/completions"), body(raw))
        assert code == 503 and "prefill" in err["error"]["message"]
    finally:
        p.stop()
