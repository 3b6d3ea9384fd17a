"""Generated input against the router (and through it, the workers) and a monolithic server: never a 5xx for
a client error, always an OpenAI-style JSON error body, and every instance keeps serving with every page free.

Two generators: malformed bodies (wrong types, garbage, one field at a time; the Responses API's and the router's
own fields among them), at the router and at a monolithic server, and well-formed bodies whose
sampling fields take extreme values all together (the query of death is a combination: a huge top_k only
crashed a sampler together with a top_p below 1). Then the failures the edge cannot refuse, injected: a
grammar compiler raising what no compiler raises fails that request alone (500, its id), and a request held
by an instance that dies is answered 500 `instance_failed` and not retried on another instance.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.procs import PDStack, serve, wait_until
from tests.integration.test_pd import FLAGS, assert_clean
from tests.timing import scaled

pytestmark = pytest.mark.integration
FAULT = {"DISAGG_FAULT_GRAMMAR_PATTERN": "boom+"}


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, *FLAGS, decodes=2, env=FAULT).wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mono(tiny_model):
    p = serve(tiny_model, *FLAGS, env=FAULT).wait_healthy()
    yield p
    p.stop()


def all_serving(stack, mono) -> None:
    """Every instance's /health is 200 and, once idle and flushed, every page is free."""
    urls = [stack.prefill.url, *(d.url for d in stack.decodes), mono.url]
    for url in [*urls, stack.router.url]:
        r = requests.get(f"{url}/health", timeout=scaled(10))
        assert r.status_code == 200, (url, r.text[:300])
    assert_clean(*urls)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.integers(-3, 40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stream",
    "stop",
    "seed",
    "logprobs",
    "model",
    "min_p",
    "stream_options",
    "input_ids",
    "sampling_params",
    "bootstrap_room",
    "presence_penalty",
    "frequency_penalty",
    "echo",
    "local_prefill",
    "resume_token_ids",
    "resume_text_chars",
    "input",
    "instructions",
    "previous_response_id",
    "max_output_tokens",
]
VALID = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/generate": {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
}
KEEP = ("max_tokens", "sampling_params", "max_output_tokens")  # generations stay short


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(VALID)))
    kind = draw(st.sampled_from(["mutate", "value", "bytes"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=64))
    if kind == "value":
        return path, json.dumps(draw(json_values)).encode()
    body = dict(VALID[path])
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(FIELDS))] = draw(json_values)
    removable = sorted(k for k in body if k not in KEEP)
    if removable and draw(st.booleans()):
        body.pop(draw(st.sampled_from(removable)), None)
    return path, json.dumps(body).encode()


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_router_never_answers_a_client_error_with_5xx(stack, case):  # noqa: F811
    path, raw = case
    r = requests.post(
        f"{stack.router.url}{path}", data=raw, headers={"Content-Type": "application/json"}, timeout=scaled(60)
    )
    assert r.status_code < 500, (path, raw, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bodies())
def test_a_monolithic_server_never_answers_a_client_error_with_5xx(mono, case):  # noqa: F811
    """The same bodies at a monolithic server, which no router fronts: the router's own fields are a client's
    there (a 400), never taken."""
    path, raw = case
    r = requests.post(f"{mono.url}{path}", data=raw, headers={"Content-Type": "application/json"}, timeout=scaled(60))
    assert r.status_code < 500, (path, raw, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]


def test_router_still_serves_after_the_fuzzing(stack):  # noqa: F811
    r = requests.post(
        f"{stack.router.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        timeout=scaled(60),
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3


# Each field's values: mostly the edges of its valid range (what the edge lets through, and the scheduler must
# survive), some just beyond them. Huge integers (top_k, seed, stop ids) are where a tensor overflows.
V = 2048  # the tiny model's vocabulary
EXTREMES = {
    "temperature": st.sampled_from([0, 1e-300, 1e-6, 0.7, 1, 2, 2.0001, -1e-300]),
    "top_p": st.sampled_from([1e-300, 1e-6, 0.5, 0.999, 1, 0, 1.0001]),
    "top_k": st.sampled_from([-1, 0, 1, 2, V - 1, V, V + 1, 2**31 - 1, 2**63, 10**30, -2]),
    "min_p": st.sampled_from([0, 1e-300, 0.5, 1, 1.0001]),
    "seed": st.sampled_from([0, -(2**63), 2**64 - 1, 2**64, 10**30]),
    "frequency_penalty": st.sampled_from([-2, -1e-300, 0, 2, 2.0001]),
    "presence_penalty": st.sampled_from([-2, 0, 1e-300, 2, -2.0001]),
    "repetition_penalty": st.sampled_from([1e-300, 1e-6, 1, 2, 1e30, 1.7e308, 0]),
    "min_tokens": st.sampled_from([0, 1, 2, 3, 10**30]),
    "max_tokens": st.sampled_from([1, 2, 3, 0, 10**30]),
    "n": st.sampled_from([1, 2, 3, 17]),
    "logprobs": st.sampled_from([0, 1, 20, 21]),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, V - 1, V, 2**31]), max_size=3) | st.just([1] * 129),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "5", str(V - 1), str(V), "99999999999"]), st.sampled_from([-100, 0, 1e-300, 100, 101])
    ),
    "ignore_eos": st.booleans(),
    "stop": st.sampled_from(["a", "\n", ["x", "y"], "z" * 1025]),
    "echo": st.booleans(),
}


@st.composite
def extreme_bodies(draw):
    """A valid request whose every sampling field may take an extreme value, many of them at once."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body = dict(VALID[path])
    for key in draw(st.lists(st.sampled_from(sorted(EXTREMES)), min_size=2, max_size=len(EXTREMES), unique=True)):
        body[key] = draw(EXTREMES[key])
    if path == "/v1/chat/completions" and "logprobs" in body:
        body["top_logprobs"], body["logprobs"] = body["logprobs"], True
    if "n" in body and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3  # keep fanned-out generations short
    return path, body


def post_extreme(url: str, case) -> None:
    path, body = case
    r = requests.post(f"{url}{path}", json=body, timeout=scaled(60))
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=extreme_bodies())
def test_extreme_sampling_values_together_never_fail_the_router(stack, case):
    post_extreme(stack.router.url, case)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=extreme_bodies())
def test_extreme_sampling_values_together_never_fail_a_monolithic_server(mono, case):
    post_extreme(mono.url, case)


def test_every_instance_serves_with_every_page_free_after_the_fuzzing(stack, mono):
    all_serving(stack, mono)


DEADLY = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_p": 0.5, "top_k": 10**30}
NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("where", ["router", "monolithic"])
def test_the_query_of_death_is_a_400_and_the_next_request_is_answered(stack, mono, where):
    url = stack.router.url if where == "router" else mono.url
    r = requests.post(f"{url}/v1/chat/completions", json=DEADLY, timeout=scaled(60))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_k" and "vocabulary size" in r.json()["error"]["message"]
    ok = requests.post(f"{url}/v1/chat/completions", json=NORMAL, timeout=scaled(60))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    all_serving(stack, mono)


@pytest.mark.parametrize("where", ["router", "monolithic"])
def test_a_grammar_compiler_fault_fails_that_request_alone_with_500(stack, mono, where):
    url = stack.router.url if where == "router" else mono.url
    r = requests.post(
        f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "regex": "boom+"}, timeout=scaled(60)
    )
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "compiling its grammar" in err["message"]
    assert "request id" in err["message"] and "CompileFault" not in err["message"]
    constrained = {"prompt": "hi", "max_tokens": 3, "regex": "ab+"}
    ok = requests.post(f"{url}/v1/completions", json=constrained, timeout=scaled(60))
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"].startswith("ab"), ok.text
    all_serving(stack, mono)


@pytest.mark.parametrize(
    "resume",
    [[10**9], [-1], ["a"], list(range(10, 30)), [10, 11]],
    ids=["outside-vocabulary", "negative", "not-an-id", "more-than-max-tokens", "well-formed"],
)
def test_a_client_resume_is_a_400_naming_it_and_the_instance_serves_on(mono, resume):
    """What a router sends a migrated request with, sent by anyone else (well-formed or not): refused, since a
    client's resume would put its own text in the answer's mouth; never a crash."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "resume_token_ids": resume}
    r = requests.post(f"{mono.url}/v1/completions", json=body, timeout=scaled(30))
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token_ids", r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "resume_text_chars": 3}
    r = requests.post(f"{mono.url}/v1/chat/completions", json=chat, timeout=scaled(30))
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume_text_chars", r.text
    plain = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}  # sampled: an EOS must not end it
    ok = requests.post(f"{mono.url}/v1/completions", json=plain, timeout=scaled(30))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8, ok.text


@pytest.mark.parametrize(
    "routing",
    [
        {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7, "resume_token_ids": [10, 11]},
        {"local_prefill": True, "resume_token_ids": [10, 11]},
        {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 7},
    ],
    ids=["resume-with-a-bootstrap-target", "resume-with-local-prefill", "bootstrap-target"],
)
def test_a_monolithic_server_takes_no_routing_fields_from_a_client(mono, routing):
    """The router's fields that a monolithic server's stage would ignore (a bootstrap target, local_prefill) do not
    carry a client's resume in: each is a 400 naming the field, and the answer is never the client's text."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, **routing}
    r = requests.post(f"{mono.url}/v1/completions", json=body, timeout=scaled(30))
    field = "local_prefill" if "local_prefill" in routing else "bootstrap_room"
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True, **routing}
    r = requests.post(f"{mono.url}/v1/chat/completions", json=chat, timeout=scaled(30))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def router_counter(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=scaled(10)).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def stats(url: str) -> dict:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()


def test_a_request_held_by_an_instance_that_dies_is_a_500_not_retried_elsewhere(stack):
    """Last in the module: it takes one decode down. The request it held gets a 500 instance_failed (it may be what
    killed the instance, so another is not risked), counted; the other decode goes on serving."""
    long = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    counter = "disagg_router_requests_failed_instance_total"
    before = router_counter(stack.router.url, counter)
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(requests.post, f"{stack.router.url}/v1/completions", json=long, timeout=scaled(120))
        holder = wait_until(
            lambda: next((d for d in stack.decodes if stats(d.url)["running"]), None),
            timeout=60,
            interval=0.05,
            what="a decode running the request",
        )
        os.kill(stats(holder.url)["pid"], signal.SIGKILL)
        r = answer.result(timeout=scaled(60))
    assert r.status_code == 500, r.text
    assert r.json()["error"]["code"] == "instance_failed" and "not retried" in r.json()["error"]["message"]
    assert router_counter(stack.router.url, counter) == before + 1
    ok = requests.post(
        f"{stack.router.url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        timeout=scaled(60),
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
