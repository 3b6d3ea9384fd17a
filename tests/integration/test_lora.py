"""LoRA adapters served by the monolithic server: three PEFT adapters (two resident at once) and the base model,
each request's greedy tokens equal to transformers + PEFT's for its `model`, also mixed in one batch and with more
adapters asked for than are resident (none refused); the prefix cache keeps an adapter's pages to that adapter;
/v1/models lists the adapters with their parent."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests

from tests.integration.procs import scaled, serve
from tests.lora_adapters import ATTENTION, MLP, greedy, peft_model, write_adapter

pytestmark = pytest.mark.integration
N = 8  # tokens each answer generates
PROMPTS = [[5, 17, 300, 42, 9, 1500, 77, 8, 640, 12, 33], [900, 4, 250, 61, 1000, 23], [7, 1024, 88, 19, 2000, 3, 45]]
MODELS = ("tiny", "attn", "mlp", "all")  # the base model's name, then the adapters'


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": write_adapter(tiny_model, root / "attn", ATTENTION, r=8, alpha=16, seed=1),
        "mlp": write_adapter(tiny_model, root / "mlp", MLP, r=4, alpha=8, seed=2, use_rslora=True),
        "all": write_adapter(tiny_model, root / "all", ATTENTION + MLP, r=2, alpha=4, seed=3),
    }


@pytest.fixture(scope="module")
def expected(tiny_model, adapters) -> dict[tuple[str, int], list[int]]:
    """transformers + PEFT's greedy tokens of each (model, prompt)."""
    ref = peft_model(tiny_model, adapters)
    return {
        (m, i): greedy(ref, p, N, None if m == "tiny" else m) for m in MODELS for i, p in enumerate(PROMPTS + [LONG])
    }


LONG = [11 + (7 * i) % 1900 for i in range(40)]  # ten pages of 4: what the prefix cache would hand on


@pytest.fixture(scope="module")
def server(tiny_model, adapters):
    modules = [f"{name}={path}" for name, path in adapters.items()]
    p = serve(
        tiny_model,
        "--served-model-name",
        "tiny",
        "--page-size",
        "4",
        "--lora-modules",
        *modules,
        "--max-loras",
        "2",  # of three: the third's requests wait for a slot
        "--max-lora-rank",
        "8",
    ).wait_healthy()
    yield p
    p.stop()


def complete(url: str, model: str, ids: list[int]) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": N, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{url}/v1/completions", json={**body, "return_token_ids": True}, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()


def tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def test_each_adapter_and_the_base_answer_as_peft_does_also_mixed_in_one_batch_beyond_max_loras(server, expected):
    for model in MODELS:
        answer = complete(server.url, model, PROMPTS[0])
        assert (answer["model"], tokens(answer)) == (model, expected[(model, 0)])
    # 24 requests at once, batched together: three adapters' for two slots, each adapter's waiting its turn
    asks = [(m, i) for i in range(len(PROMPTS)) for m in MODELS] * 2
    with cf.ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda a: tokens(complete(server.url, a[0], PROMPTS[a[1]])), asks))
    assert got == [expected[a] for a in asks]
    assert "LoRA adapter all resident in slot" in server.logs()  # the third adapter took a slot of the first two
    assert len({tuple(expected[(m, 0)]) for m in MODELS}) == len(MODELS)  # the adapters do change the answers


def test_a_prefix_cached_under_one_adapter_is_not_reused_for_another_or_the_base(server, expected):
    long = len(PROMPTS)
    first = complete(server.url, "attn", LONG)
    again = complete(server.url, "attn", LONG)
    assert tokens(first) == tokens(again) == expected[("attn", long)]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the cache is on, and hit by its own
    for model in ("mlp", "all", "tiny"):
        answer = complete(server.url, model, LONG)
        assert tokens(answer) == expected[(model, long)]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_models_lists_the_adapters_with_the_base_as_parent(server):
    data = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), *((a, "tiny") for a in MODELS[1:])]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_unknown_model_is_a_404_naming_model(server, path):
    body = {"model": "nope", "max_tokens": 2, "prompt": [5, 6], "messages": [{"role": "user", "content": "hi"}]}
    r = requests.post(f"{server.url}{path}", json=body, timeout=10)
    error = r.json()["error"]
    assert (r.status_code, error["param"], error["code"]) == (404, "model", "model_not_found")
    assert "nope" in error["message"]


def test_an_adapter_above_the_maximum_rank_stops_the_start_up_naming_it(tiny_model, adapters):
    p = serve(tiny_model, "--lora-modules", f"attn={adapters['attn']}", "--max-lora-rank", "4")
    assert p.wait_exit(60) == 2
    assert "LoRA adapter attn: rank 8 exceeds --max-lora-rank 4" in p.logs()
