"""The monolithic server as a user meets it: real processes, real HTTP."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
from pathlib import Path

import pytest
import requests

from tests.integration.procs import idle_and_flushed, idle_now, report_after, scaled, serve, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 32


@pytest.fixture(scope="module")
def server(tiny_model):
    p = serve(
        tiny_model,
        "--page-size",
        "4",
        "--chunk-size",
        str(CHUNK),
        "--max-total-tokens",
        "8192",
        # /health fails after this long without a scheduler report: scaled, so that a slow scheduler is not
        # taken for a stuck one.
        "--health-timeout",
        f"{scaled(3):g}",
    ).wait_healthy()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference_server(tiny_model):
    """Batching, prefix cache, chunking and overlap all off."""
    p = serve(
        tiny_model,
        "--page-size",
        "4",
        "--chunk-size",
        "0",
        "--max-running-requests",
        "1",
        "--disable-prefix-cache",
        "--disable-overlap",
    ).wait_healthy()
    yield p
    p.stop()


def varied_prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(10, 2000) for _ in range(60)]
    out = []
    for i in range(n):
        own = [rng.randrange(10, 2000) for _ in range(rng.choice([1, 5, 20, 45, 100, 150]))]
        out.append(shared[: rng.choice([12, 33, 60])] + own if i % 3 == 0 else own)
    return out


def generate(url: str, ids: list[int], n: int = 12) -> list[int]:
    r = requests.post(
        f"{url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
        timeout=scaled(120),
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_concurrent_greedy_equals_one_at_a_time(server, reference_server):
    prompts = varied_prompts(32)
    assert sum(len(p) > CHUNK for p in prompts) >= 8
    expected = [generate(reference_server.url, p) for p in prompts]
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: generate(server.url, p), prompts))
    assert got == expected
    st = idle_and_flushed(server.url)
    assert st["cache_refs"] == 0 and st["pages_used"] == 0


def post(url, path, body, **kw):
    return requests.post(
        f"{url}{path}",
        data=body if isinstance(body, (bytes, str)) else json.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=scaled(60),
        **kw,
    )


@pytest.mark.parametrize(
    "body,status,param",
    [
        (b"{not json", 400, None),
        ([1, 2, 3], 400, None),
        ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": "hi", "n": 0}, 400, "n"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ],
)
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param


def test_prompt_over_kv_capacity_is_400(server):
    r = post(server.url, "/v1/completions", {"prompt": list(range(10, 10 + 9000)), "max_tokens": 1})
    assert r.status_code == 400
    assert "KV cache" in r.json()["error"]["message"] or "context" in r.json()["error"]["message"]


def test_chat_streaming_with_usage(server):
    body = {
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    with requests.post(f"{server.url}/v1/chat/completions", json=body, stream=True, timeout=scaled(60)) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    full = post(server.url, "/v1/chat/completions", plain).json()
    assert full["choices"][0]["message"]["content"] == text


def test_n_choices_and_logprobs(server):
    r = post(
        server.url,
        "/v1/completions",
        {"prompt": "The sea", "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 11, "logprobs": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == 5 and all(x <= 0 for x in lp["token_logprobs"])
        assert all(len(t) == 2 for t in lp["top_logprobs"])
    assert body["usage"]["completion_tokens"] == 15
    again = post(
        server.url,
        "/v1/completions",
        {"prompt": "The sea", "max_tokens": 5, "n": 3, "temperature": 1.0, "seed": 11, "logprobs": 2},
    ).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]


def test_stop_string_cuts_the_text(server):
    base = post(
        server.url, "/v1/completions", {"prompt": "Once", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ).json()["choices"][0]["text"]
    stop = base[3:6]
    assert stop
    r = post(
        server.url,
        "/v1/completions",
        {"prompt": "Once", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]},
    ).json()
    assert r["choices"][0]["text"] == base[: base.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_client_disconnect_aborts_and_frees_pages(server):
    max_tokens = 3000
    steps_before = idle_now(server.url)["step_count"]  # idle: no step runs until the request comes
    body = {"prompt": list(range(20, 300)), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with requests.post(f"{server.url}/v1/completions", json=body, stream=True, timeout=scaled(60)) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # The connection is closed: the request stops, however fast or slow this machine is, long before its 3000
    # tokens (each a scheduler step of its own, the only request running); then its pages are freed.
    steps = idle_now(server.url)["step_count"] - steps_before
    assert steps < max_tokens, f"the scheduler ran {steps} steps: the request was generated to its end"
    st = idle_and_flushed(server.url)
    assert st["pages_used"] == 0 and st["cache_refs"] == 0


def test_models_health_metrics(server):
    models = requests.get(f"{server.url}/v1/models", timeout=scaled(5)).json()
    assert models["data"][0]["object"] == "model"
    assert requests.get(f"{server.url}/health", timeout=scaled(5)).status_code == 200
    text = requests.get(f"{server.url}/metrics", timeout=scaled(5)).text
    for name in (
        "disagg_num_running_requests",
        "disagg_kv_pages_used",
        "disagg_kv_pages_free",
        "disagg_prefix_cache_hit_rate",
        "disagg_time_to_first_token_seconds_bucket",
        "disagg_inter_token_latency_seconds_bucket",
        "disagg_e2e_request_latency_seconds_bucket",
        "disagg_generation_tokens_total",
    ):
        assert name in text


def test_health_fails_when_the_scheduler_is_stuck(server):
    pid = report_after(server.url, 0, lambda st: True, 30, "reporting")["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(
            lambda: requests.get(f"{server.url}/health", timeout=scaled(5)).status_code == 503,
            timeout=15,
            what="/health failing",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(
        lambda: requests.get(f"{server.url}/health", timeout=scaled(5)).status_code == 200,
        timeout=15,
        what="/health recovering",
    )
