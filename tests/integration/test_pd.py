"""Prefill/decode disaggregation end to end: router -> prefill -> decode, real Mooncake TCP."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import pytest
import requests

from tests.integration.procs import PDStack, idle_and_flushed, scaled, serve, wait_until
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192")
# Prefill streams the KV of prompts of 40 tokens or more layer by layer (on by default, from 2048 tokens), and sends
# shorter ones whole after each chunk: one stack runs both paths (`varied_prompts` are 1 to 210 tokens, most over a
# 32-token chunk).
LAYERWISE = ("--disagg-layer-pipeline-min-prefill-len", "40", "--disagg-layer-group-size", "1")


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, *FLAGS, prefill_flags=LAYERWISE).wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mono(tiny_model):
    p = serve(tiny_model, *FLAGS).wait_healthy()
    yield p
    p.stop()


def assert_clean(*urls: str) -> None:
    """Every queue is empty and, after flushing the prefix cache, every page is free (in every attention group of
    an instance with DP attention)."""
    for url in urls:
        st = idle_and_flushed(url)
        for part in [st, *st.get("groups", [])]:
            assert part["pages_used"] == 0 and part["cache_refs"] == 0, (url, st)
            assert not any(part["queues"].values()), (url, st)


def test_pd_greedy_equals_monolithic(stack, mono):
    prompts = varied_prompts(32)
    expected = [generate(mono.url, p) for p in prompts]
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: generate(stack.router.url, p), prompts))
    assert got == expected
    assert_clean(stack.prefill.url, stack.decode.url)


def test_long_prompts_streamed_their_kv_layer_by_layer_and_short_ones_whole(stack, mono):
    prompts = [p for p in varied_prompts(32) if len(p) >= 40][:3] + [[11, 12, 13]]
    before = metric(stack.prefill.url, "disagg_kv_layer_group_send_seconds_count")
    assert [generate(stack.router.url, p) for p in prompts] == [generate(mono.url, p) for p in prompts]
    groups = "disagg_kv_layer_group_send_seconds_count"  # the scheduler's series reach /metrics a moment later
    wait_until(lambda: metric(stack.prefill.url, groups) > before, timeout=10, interval=0.2, what="groups counted")
    hidden = metric(stack.prefill.url, "disagg_kv_layer_hidden_ratio_sum")
    assert 0 <= hidden <= metric(stack.prefill.url, "disagg_kv_layer_hidden_ratio_count")


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus series over its labels, read from `url`'s /metrics."""
    text = requests.get(f"{url}/metrics", timeout=scaled(10)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_pd_openai_endpoints_match_monolithic(stack, mono):
    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    a = requests.post(f"{stack.router.url}/v1/completions", json=body, timeout=scaled(60)).json()
    b = requests.post(f"{mono.url}/v1/completions", json=body, timeout=scaled(60)).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert a["usage"] == b["usage"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "stream": True}
    with requests.post(f"{stack.router.url}/v1/chat/completions", json=chat, stream=True, timeout=scaled(60)) as r:
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    mono_text = requests.post(
        f"{mono.url}/v1/chat/completions", json={**chat, "stream": False}, timeout=scaled(60)
    ).json()["choices"][0]["message"]["content"]
    assert text == mono_text


def sampled(url: str, ids: list[int], seed: int) -> list[int]:
    params = {"max_new_tokens": 16, "temperature": 1.5, "top_k": 0, "seed": seed, "ignore_eos": True}
    r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_pd_seeded_sampling_equals_monolithic(stack, mono):
    """Prefill samples the first token with the request's seed; decode goes on past that draw."""
    prompts = varied_prompts(6)
    expected = [sampled(mono.url, p, seed) for seed, p in enumerate(prompts)]
    got = [sampled(stack.router.url, p, seed) for seed, p in enumerate(prompts)]
    assert got == expected
    assert len({tuple(ids) for ids in expected}) == len(prompts)  # sampled, not one fixed answer
    again = [sampled(mono.url, p, seed + 100) for seed, p in enumerate(prompts)]
    assert again != expected  # the seed decides the tokens


def test_tools_and_unknown_response_formats_are_a_400_through_the_router(stack):
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    chat = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 4}
    for extra, param, says in (
        ({"tools": [tool]}, "tools", "chat template does not support tool calling"),  # the tiny model's has none
        ({"response_format": {"type": "yaml"}}, "response_format", "not supported"),
    ):
        r = requests.post(f"{stack.router.url}/v1/chat/completions", json={**chat, **extra}, timeout=scaled(60))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        assert says in r.json()["error"]["message"]


def test_a_forced_tool_call_through_the_router_on_a_template_without_tools(stack):
    tool = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
    chat = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 200, "tools": [tool]}
    r = requests.post(
        f"{stack.router.url}/v1/chat/completions", json={**chat, "tool_choice": "required"}, timeout=scaled(60)
    )
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    args = json.loads(call["function"]["arguments"])
    assert isinstance(args["ok"], bool) and args["colour"] in ("red", "green", "blue") and len(args) == 2


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


def structured(url: str, content: str, fmt: dict, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 40, "response_format": fmt, **extra}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=scaled(60))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}], ids=["greedy", "seeded"])
def test_response_format_json_schema_monolithic_and_pd(stack, mono, sampling):
    """The tiny model knows no JSON: whatever it answers is the grammar's doing; P/D gives the same."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    for content in ("Is the sky blue?", "Pick a colour", "x"):
        a, b = (structured(url, content, fmt, **sampling) for url in (mono.url, stack.router.url))
        assert a["message"]["content"] == b["message"]["content"]
        answer = json.loads(a["message"]["content"])
        assert set(answer) == {"ok", "colour"} and answer["colour"] in ("red", "green", "blue"), answer
        assert a["finish_reason"] == b["finish_reason"] == "stop"
    # json_object: any object; the tiny model may write one endless key, so a cut answer only has to start as one.
    for choice in (structured(url, "hi", {"type": "json_object"}) for url in (mono.url, stack.router.url)):
        text = choice["message"]["content"]
        assert isinstance(json.loads(text), dict) if choice["finish_reason"] == "stop" else text.startswith('{"')
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    r = requests.post(
        f"{mono.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "response_format": bad},
        timeout=scaled(60),
    )
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text


CONSTRAINED = [
    ("/v1/completions", {"prompt": "Answer:", "regex": r"(yes|no), [0-9]{2,3}"}, r"(yes|no), [0-9]{2,3}"),
    ("/v1/chat/completions", {"ebnf": 'root ::= "colour: " ("red" | "blue")'}, r"colour: (red|blue)"),
    (
        "/v1/completions",
        {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        None,
    ),
]


@pytest.mark.parametrize("path, extra, full", CONSTRAINED, ids=["regex-completions", "ebnf-chat", "schema-completions"])
def test_regex_ebnf_and_completions_schema_monolithic_and_pd(stack, mono, path, extra, full):
    body = {"max_tokens": 40, "temperature": 1.0, "seed": 11, **extra}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Pick one"}]
    texts = []
    for url in (mono.url, stack.router.url):
        r = requests.post(f"{url}{path}", json=body, timeout=scaled(60))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
    assert texts[0] == texts[1]
    if full is not None:
        assert re.fullmatch(full, texts[0]), texts[0]
    else:
        assert set(json.loads(texts[0])) == {"ok", "colour"}, texts[0]


def test_a_regex_that_does_not_compile_is_a_400_naming_it_through_the_router(stack):
    r = requests.post(f"{stack.router.url}/v1/completions", json={"prompt": "x", "regex": "(open"}, timeout=scaled(60))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("regex: the pattern cannot be used"), r.text


def test_n_greater_than_one_uses_distinct_rooms(stack):
    body = {"prompt": "The sea", "max_tokens": 4, "n": 4, "temperature": 1.0, "seed": 5}
    r = requests.post(f"{stack.router.url}/v1/completions", json=body, timeout=scaled(60))
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    assert r.json()["usage"]["completion_tokens"] == 16


def test_prompt_over_capacity_is_400_through_the_router(stack):
    r = requests.post(
        f"{stack.router.url}/v1/completions",
        json={"prompt": list(range(10, 9010)), "max_tokens": 1},
        timeout=scaled(60),
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_workers_refuse_requests_without_a_room(stack):
    for url in (stack.prefill.url, stack.decode.url):
        r = requests.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=scaled(30))
        assert r.status_code == 400
        assert "bootstrap_room" in r.json()["error"]["message"]


def test_router_health_lists_workers(stack):
    h = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()
    assert h["status"] == "ok"
    assert sorted(w["role"] for w in h["workers"]) == ["decode", "prefill"]
    # Each worker's load as the router weighs it (other routers' requests included): it comes down to none once
    # the earlier tests' requests and the router's pair probes have ended (reports come every half second).
    for url in (stack.prefill.url, stack.decode.url):
        load = wait_until(
            lambda u=url: (d := requests.get(f"{u}/health", timeout=scaled(5)).json()["load"])["requests"] == 0 and d,
            timeout=20,
            what=f"{url} reporting no request held",
        )
        assert load["kv_total"] > 0 and 0 <= load["kv_used"] <= load["kv_total"], load
    m = requests.get(f"{stack.prefill.url}/metrics", timeout=scaled(5)).text
    for name in (
        'queue="prefill_bootstrap"',
        'queue="prefill_inflight"',
        "disagg_kv_transfer_seconds_bucket",
        "disagg_kv_transfer_bytes_total",
    ):
        assert name in m
    m = requests.get(f"{stack.decode.url}/metrics", timeout=scaled(5)).text
    for name in ('queue="decode_prealloc"', 'queue="decode_transfer"'):
        assert name in m


def test_a_stream_with_usage_through_the_router(stack, mono):
    """stream_options travels to decode only: prefill answers one token, never streamed."""
    body = {"prompt": "The sea", "max_tokens": 7, "temperature": 0, "ignore_eos": True}
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    with requests.post(
        f"{stack.router.url}/v1/completions", json={**body, **opts}, stream=True, timeout=scaled(60)
    ) as r:
        assert r.status_code == 200, r.text
        r.encoding = "utf-8"
        events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 7
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert (
        text == requests.post(f"{mono.url}/v1/completions", json=body, timeout=scaled(60)).json()["choices"][0]["text"]
    )


# Echoed prompt logprobs against transformers' log-softmax on the same float32 weights. Measured on this CPU:
# equal (max |diff| 0.0); the tolerance leaves room for kernels that sum in another order.
PROMPT_LOGPROB_TOLERANCE = 1e-4


def echoed(url: str, prompt: str, stream: bool = False, **extra) -> dict:
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "stream": stream, **extra}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=scaled(60), stream=stream)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    return events[0]["choices"][0]


def test_echoed_prompt_logprobs_equal_transformers_monolithic_and_pd(stack, mono, tiny_model):
    """Through P/D the prompt's logprobs come from prefill (a prompt over several 32-token chunks); a second
    request for the same prompt is computed again, not read from the prefix cache."""
    import torch
    import transformers

    from disagg_worker.model.tokenizer import Tokenizer

    prompt = (
        "Once upon a time, in a small village by the sea, there lived an old fisherman and his three daughters. " * 3
    )
    ids = Tokenizer.from_path(tiny_model).encode(prompt)
    assert len(ids) > 64
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.inference_mode():
        lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = lps[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    best = lps[:-1].topk(2, dim=-1).indices.tolist()
    for url, stream in ((mono.url, False), (stack.router.url, False), (stack.router.url, True), (mono.url, False)):
        c = echoed(url, prompt, stream)
        assert c["text"] == prompt and c["finish_reason"] == "length"
        got = c["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) and got[0] is None and c["logprobs"]["top_logprobs"][0] is None
        diff = max(abs(a - b) for a, b in zip(got[1:], expected, strict=True))
        print(f"echoed prompt logprobs vs transformers, {url} stream={stream}: max |diff| {diff:.2e}")
        assert diff < PROMPT_LOGPROB_TOLERANCE
        # Two alternatives that decode to the same text (bytes of one character) are one entry of OpenAI's map.
        assert all(1 <= len(t) <= 2 for t in c["logprobs"]["top_logprobs"][1:])
        tok = Tokenizer.from_path(tiny_model)
        assert [set(t) for t in c["logprobs"]["top_logprobs"][1:5]] == [
            {tok.decode([i], skip_special_tokens=False) for i in b} for b in best[:4]
        ]
    more = echoed(stack.router.url, prompt, max_tokens=3, temperature=0)
    assert more["text"].startswith(prompt) and len(more["logprobs"]["token_logprobs"]) == len(ids) + 3
    assert more["logprobs"]["token_logprobs"][1:4] == pytest.approx(expected[:3], abs=PROMPT_LOGPROB_TOLERANCE)
