"""LoRA adapters through P/D: a router, a prefill holding three adapters and a decode holding two of them (one slot,
its prefix cache on). Each adapter's and the base model's greedy tokens equal transformers + PEFT's (those
test_lora.py checks the monolithic server gives), one at a time and mixed at once; the decode's cached pages of
one adapter are never another's; the router lists the adapters a pair serves and answers 404 naming `model` for
one no pair serves, and its /health lists each worker's adapters (what the operator's Ready reads); a decode
without the adapter refuses it (404 naming `model`) when a gateway hands it off, the prefill's half freed; the
workers' /metrics report lora_requests_info; an adapter's requests stay on the decode holding it resident; seeded
sampling under each adapter equals a monolithic server's."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from disagg_operator.routerview import merge_reports
from tests.integration.procs import FAST_FAILURE, PDStack, Proc, free_port, idle_now, scaled, serve
from tests.integration.test_lora import LONG, PROMPTS, adapters, complete, expected, tokens
from tests.timing import wait_until

pytestmark = pytest.mark.integration
__all__ = ["adapters", "expected"]  # test_lora.py's module fixtures: the adapters and PEFT's answers
SERVED = ("tiny", "attn", "mlp")  # the base model, then the adapters both roles hold
HEADER = "x-prefiller-host-port"


@pytest.fixture(scope="module")
def stack(tiny_model, adapters):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    s = PDStack(
        tiny_model,
        "--page-size",
        "4",
        "--max-lora-rank",
        "8",
        prefill_flags=("--lora-modules", *modules, "--max-loras", "2"),  # attn, mlp and all
        decode_flags=("--lora-modules", *modules[:2], "--max-loras", "1", "--decode-prefix-cache"),
    ).wait_healthy()
    yield s
    s.stop()


def test_each_adapter_and_the_base_answer_through_pd_as_peft_does_also_mixed_at_once(stack, expected):
    for model in SERVED:
        answer = complete(stack.router.url, model, PROMPTS[0])
        assert (answer["model"], tokens(answer)) == (model, expected[(model, 0)])
    asks = [(m, i) for i in range(len(PROMPTS)) for m in SERVED] * 2  # two adapters for decode's one slot
    with cf.ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: tokens(complete(stack.router.url, a[0], PROMPTS[a[1]])), asks))
    assert got == [expected[a] for a in asks]
    assert "LoRA adapter mlp resident in slot 1" in stack.decode.logs()  # it took attn's one slot, in turn


def test_the_decodes_cached_pages_of_one_adapter_are_never_another_adapters(stack, expected):
    long = len(PROMPTS)
    for model in ("attn", "attn", "mlp", "tiny"):  # attn's pages cached on decode, then the same prompt again
        assert tokens(complete(stack.router.url, model, LONG)) == expected[(model, long)], model


def test_the_router_lists_the_adapters_a_pair_serves_with_the_base_as_parent(stack):
    data = requests.get(f"{stack.router.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("attn", "tiny"), ("mlp", "tiny")]


def test_the_routers_health_lists_each_workers_adapters_as_the_operators_ready_reads_them(stack):
    report = requests.get(f"{stack.router.url}/health", timeout=10).json()
    held = {w["role"]: w.get("lora_adapters") for w in report["workers"]}
    assert held == {"prefill": ["attn", "mlp", "all"], "decode": ["attn", "mlp"]}
    # spec.lora's Ready (operator/disagg_operator/routerview.py) on this very report: what a pair serves.
    assert merge_reports({"router-0": report}).adapters == {"attn", "mlp"}


@pytest.mark.parametrize("model", ["all", "nope"])  # all: held by the prefill alone; nope: by no worker
def test_an_adapter_no_pair_serves_is_a_404_naming_model(stack, model):
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 2}
    r = requests.post(f"{stack.router.url}/v1/completions", json=body, timeout=scaled(30))
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (404, "model", "model_not_found")
    assert f"`{model}`" in error["message"]


def test_a_decode_without_the_adapter_refuses_it_when_handed_off_and_the_prefill_lets_go(stack, tiny_model):
    port = free_port()
    args = ["decode", "--model", tiny_model, "--port", str(port), "--served-model-name", "tiny", "--page-size", "4"]
    decode = Proc([*args, *FAST_FAILURE, "--bootstrap-port", str(stack.bootstrap_port)], port).wait_healthy()
    try:
        prefill = {HEADER: f"127.0.0.1:{stack.prefill.port}"}
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{decode.url}/v1/completions", json={**body, "model": "attn"}, headers=prefill, timeout=30)
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["code"]) == (404, "model", "model_not_found"), r.text
        idle_now(stack.prefill.url)  # the prefill's half, which waited for this decode, ended
        r = requests.post(f"{decode.url}/v1/completions", json={**body, "model": "tiny"}, headers=prefill, timeout=30)
        assert (r.status_code, r.json()["choices"][0]["finish_reason"]) == (200, "length"), r.text  # the base
    finally:
        decode.stop()


def test_the_workers_report_lora_requests_info(stack):
    for proc, max_lora in ((stack.prefill, "2"), (stack.decode, "1")):
        text = requests.get(f"{proc.url}/metrics", timeout=10).text
        for name in ("disagg_lora_requests_info", "vllm:lora_requests_info"):
            assert any(line.startswith(name) and f'max_lora="{max_lora}"' in line for line in text.splitlines())


def resident_decode(stack: PDStack, model: str) -> str | None:
    """The decode the router's last health round saw holding `model` resident (None: none yet)."""
    report = requests.get(f"{stack.router.url}/health", timeout=10).json()
    warm = [w["url"] for w in report["workers"] if w["role"] == "decode" and model in w.get("lora_resident", [])]
    return warm[0] if len(warm) == 1 else None


def test_requests_for_an_adapter_go_to_the_decode_holding_it_resident(tiny_model, adapters, expected):
    """Two decodes of one slot each, both starting with `attn` in it: the first `mlp` request loads `mlp` into
    one of them, and every later one goes there (round robin would send every other one to the second decode,
    which would load it too)."""
    modules = [f"{name}={path}" for name, path in adapters.items()][:2]  # attn, mlp
    s = PDStack(
        tiny_model,
        "--page-size",
        "4",
        "--max-lora-rank",
        "8",
        prefill_flags=("--lora-modules", *modules, "--max-loras", "2"),
        decode_flags=("--lora-modules", *modules, "--max-loras", "1"),
        router_flags=("--policy", "round_robin"),
        decodes=2,
    ).wait_healthy()
    try:
        assert tokens(complete(s.router.url, "mlp", PROMPTS[0])) == expected[("mlp", 0)]
        warm = wait_until(lambda: resident_decode(s, "mlp"), scaled(30), 0.2, what="the router seeing mlp resident")
        for i in range(4):
            assert tokens(complete(s.router.url, "mlp", PROMPTS[i % 3])) == expected[("mlp", i % 3)]
        loads = {d.url: d.logs().count("LoRA adapter mlp resident in slot") for d in s.decodes}
        assert loads == {d.url: int(d.url == warm) for d in s.decodes}, "mlp loaded once, on the decode it stayed on"
        # The base model and `attn` still go to both: affinity narrows an adapter's requests only.
        assert tokens(complete(s.router.url, "attn", PROMPTS[1])) == expected[("attn", 1)]
    finally:
        s.stop()


def sampled(url: str, model: str, ids: list[int], seed: int) -> list[int]:
    body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": seed}
    r = requests.post(f"{url}/v1/completions", json={**body, "ignore_eos": True, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    return tokens(r.json())


def test_seeded_sampling_under_each_adapter_through_pd_equals_a_monolithic_servers(stack, tiny_model, adapters):
    """The first token is sampled at prefill and the rest at decode, each under the request's adapter: the same
    seeded tokens as one monolithic instance (chunked prefill on there, the prompt in chunks of 4) gives."""
    modules = [f"{name}={path}" for name, path in adapters.items()][:2]
    mono = serve(
        tiny_model,
        "--served-model-name",
        "tiny",
        "--page-size",
        "4",
        "--chunk-size",
        "4",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        *modules,
        "--max-loras",
        "2",
    ).wait_healthy()
    try:
        for model in SERVED:
            for seed in (1, 2):
                want = sampled(mono.url, model, PROMPTS[0], seed)
                assert sampled(stack.router.url, model, PROMPTS[0], seed) == want, (model, seed)
        # ... and the seeds matter, as do the adapters: not the same tokens whatever is asked.
        answers = {(m, s): tuple(sampled(mono.url, m, PROMPTS[0], s)) for m in SERVED for s in (1, 2)}
        assert len(set(answers.values())) > len(SERVED)
    finally:
        mono.stop()
