"""Decode's prefix cache and conditional disaggregation on real processes (a prefill, a decode with
`--decode-prefix-cache --local-prefill`, a cache-aware router with `--decode-only-tokens`, and a monolithic server
to compare with).

A conversation's second turn, whose start decode holds from the first, gets only the pages decode lacks from
prefill (counted in bytes); a prompt decode lacks few tokens of is computed by decode alone (prefill sees no
request); every answer, greedy and seeded, equals the monolithic server's."""

from __future__ import annotations

import time

import pytest
import requests

from disagg_worker.mem.allocator import pages_for
from disagg_worker.mem.kv_events import page_hashes
from tests.integration.procs import PDStack, Proc, idle_now, report_after, scaled, serve, wait_until
from tests.integration.test_kv_events import held, router_entry
from tests.integration.test_router_verify import counter

pytestmark = pytest.mark.integration
PAGE = 4
THRESHOLD = 8  # --decode-only-tokens
FLAGS = ("--page-size", str(PAGE), "--chunk-size", "32", "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def stack(tiny_model):
    # No pair verification: its probes would move the transfer bytes this test counts.
    router_flags = (
        "--policy",
        "cache_aware",
        "--tokenizer",
        tiny_model,
        "--decode-only-tokens",
        str(THRESHOLD),
        "--verify-interval",
        "0",
    )
    s = PDStack(
        tiny_model, *FLAGS, decode_flags=("--decode-prefix-cache", "--local-prefill"), router_flags=router_flags
    ).wait_healthy()
    mono = serve(tiny_model, "--served-model-name", "tiny", *FLAGS).wait_healthy()
    yield s, mono
    mono.stop()
    s.stop()


def run(url: str, ids: list[int], n: int, seed: int | None = None) -> list[int]:
    params = {"max_new_tokens": n, "temperature": 0 if seed is None else 1.0, "ignore_eos": True}
    if seed is not None:
        params["seed"] = seed
    r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def routed(router: Proc) -> dict:
    return requests.get(f"{router.url}/health", timeout=scaled(5)).json()["routing"]


def decode_holds(s: PDStack, ids: list[int]) -> None:
    """Wait until decode's cache holds the whole pages of `ids` and the router's index of decode says so."""
    names = set(page_hashes(ids, PAGE))
    wait_until(
        lambda: (
            held(s.decode.url)[1] >= names
            and router_entry(s.router.url, s.decode.url)["kv_index"]["pages"] >= len(names)
        ),
        15,
        what="decode's cache (and the router's index of it) holding the turn",
    )


def prefill_bytes_after(s: PDStack, before: float) -> float:
    """The prefill's transfer bytes once they moved past `before` (its report reaches /metrics a moment later)."""
    return wait_until(
        lambda: (now := counter(s.prefill, "disagg_kv_transfer_bytes_total")) != before and now,
        10,
        interval=0.1,
        what="the prefill's transfer bytes moving",
    )


def test_a_second_turn_receives_only_the_pages_decode_lacks_and_a_third_runs_on_decode_alone(stack):
    s, mono = stack
    first = list(range(500, 540))  # 40 tokens, 10 pages: P/D, decode had nothing
    out1 = run(s.router.url, first, n=6)
    assert out1 == run(mono.url, first, n=6)
    bytes0 = prefill_bytes_after(s, 0.0)
    page_bytes = bytes0 / pages_for(len(first), PAGE)
    history = first + out1  # decode computed all but the last output token's KV: 45 tokens, 11 whole pages
    decode_holds(s, history[:-1])
    idle_now(s.decode.url)

    second = history + list(range(700, 720))  # lacks 20 + a page's remainder: more than THRESHOLD, so P/D
    routes = routed(s.router)
    out2 = run(s.router.url, second, n=6)
    assert out2 == run(mono.url, second, n=6)
    assert routed(s.router).get("routed_pd", 0) == routes.get("routed_pd", 0) + 1
    held_pages = (len(history) - 1) // PAGE
    sent = prefill_bytes_after(s, bytes0) - bytes0
    assert sent == page_bytes * (pages_for(len(second), PAGE) - held_pages), (sent, page_bytes, held_pages)

    third = second + out2 + [901, 902, 903]  # decode holds all but 3 tokens and a page's remainder: decode alone
    decode_holds(s, (second + out2)[:-1])
    requests_before, routes = counter(s.prefill, "disagg_requests_total"), routed(s.router)
    out3 = run(s.router.url, third, n=6)
    assert out3 == run(mono.url, third, n=6)
    assert routed(s.router)["routed_decode_only"] == routes.get("routed_decode_only", 0) + 1
    # Decode computed the third turn from its cache: every whole page of the second turn's history was a hit.
    hits = held_pages * PAGE + (len(second + out2) - 1) // PAGE * PAGE
    report_after(s.decode.url, time.time(), lambda st: st["cache_hit_tokens"] >= hits, scaled(10), "decode's hits")
    assert counter(s.prefill, "disagg_kv_transfer_bytes_total") == bytes0 + sent
    assert counter(s.prefill, "disagg_requests_total") == requests_before


def test_short_prompts_run_on_decode_alone_with_greedy_and_seeded_answers_equal_to_monolithic(stack):
    s, mono = stack
    before = routed(s.router).get("routed_decode_only", 0)
    prompts = [[11, 12, 13], [40, 41, 42, 43, 44, 45, 46], [3]]
    for ids in prompts:
        assert run(s.router.url, ids, n=8) == run(mono.url, ids, n=8)
        assert run(s.router.url, ids, n=8, seed=5) == run(mono.url, ids, n=8, seed=5)
    assert routed(s.router)["routed_decode_only"] == before + 2 * len(prompts)
    metrics = requests.get(f"{s.router.url}/metrics", timeout=scaled(5)).text
    assert f'disagg_router_requests_routed_total{{path="decode_only"}} {before + 2 * len(prompts)}.0' in metrics
    assert f'disagg_router_kv_index_state{{role="decode",state="ok",worker="{s.decode.url}"}} 1.0' in metrics


def test_local_prefill_is_refused_where_it_is_not_offered(stack):
    s, _ = stack
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "local_prefill": True}
    r = requests.post(f"{s.prefill.url}/generate", json=body, timeout=scaled(30))
    assert r.status_code == 400 and "does not compute prompts for local_prefill" in r.json()["error"]["message"]
    r = requests.post(f"{s.decode.url}/generate", json={**body, "local_prefill": "yes"}, timeout=scaled(30))
    assert r.status_code == 400 and r.json()["error"]["param"] == "local_prefill"
