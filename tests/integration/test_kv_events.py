"""KV events on real processes: the router's index of the prefill instance's prefix cache equals what the
instance holds after requests, after a flush, and after the instance restarts (a new epoch: a snapshot)."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from disagg_worker.mem.kv_events import HASH_SCHEME, page_hashes
from tests.integration.procs import PDStack, idle_now, report_after, scaled
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration
PAGE = 4
FLAGS = ("--page-size", str(PAGE), "--chunk-size", "32", "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, *FLAGS).wait_healthy()
    yield s
    s.stop()


def held(url: str) -> tuple[dict, set[int]]:
    """An instance's /kv_events snapshot: its header and the names of the pages it holds."""
    r = requests.get(f"{url}/kv_events", timeout=scaled(5))
    assert r.status_code == 200, r.text
    body = r.json()
    return body, {int(n, 16) for n in body["snapshot"]}


def router_entry(stack: PDStack, worker_url: str) -> dict:
    body = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()
    return next(w for w in body["workers"] if w["url"] == worker_url)


def router_index_reaches(stack: PDStack, worker_url: str, pred, what: str) -> dict:
    deadline = time.monotonic() + scaled(15)
    while True:
        entry = router_entry(stack, worker_url)
        if pred(entry["kv_index"]):
            return entry["kv_index"]
        assert time.monotonic() < deadline, f"the router's index never showed {what}: {entry}"
        time.sleep(0.2)


def settled(stack: PDStack) -> tuple[dict, set[int]]:
    """The prefill's holdings once a report made after its last request has reached the HTTP process."""
    idle_now(stack.prefill.url)
    report_after(stack.prefill.url, time.time(), lambda st: True, scaled(10), "a report")
    return held(stack.prefill.url)


def test_the_routers_index_follows_the_prefill_instances_cache(stack):
    prompts = varied_prompts(12)
    with cf.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda ids: generate(stack.router.url, ids, n=4), prompts))
    header, names = settled(stack)
    assert header["hash_scheme"] == HASH_SCHEME and header["page_size"] == PAGE and header["model"] == "tiny"
    stats = requests.get(f"{stack.prefill.url}/stats", timeout=scaled(5)).json()
    assert len(names) == stats["cache_pages"] > 0
    # Every prompt's whole pages before its last token are cached, under the names the router computes.
    for ids in prompts:
        assert set(page_hashes(ids[:-1], PAGE)) <= names

    index = router_index_reaches(stack, stack.prefill.url, lambda i: i["pages"] == len(names), f"{len(names)} pages")
    assert index["state"] == "ok"
    decode = router_entry(stack, stack.decode.url)["kv_index"]
    assert decode["state"] == "ok" and decode["pages"] == 0  # decode caches no prompts

    requests.post(f"{stack.prefill.url}/flush_cache", timeout=scaled(5))
    header, names = settled(stack)
    assert names == set()
    router_index_reaches(stack, stack.prefill.url, lambda i: i["pages"] == 0, "the flush")


def test_a_restarted_prefill_instance_is_indexed_afresh(stack):
    generate(stack.router.url, varied_prompts(3)[2], n=2)
    before = router_index_reaches(stack, stack.prefill.url, lambda i: i["pages"] > 0, "the request's pages")
    port = int(stack.prefill.url.rsplit(":", 1)[1])
    stack.prefill.stop()
    stack.prefill = stack.start_prefill(port).wait_healthy()
    # A new process: a new epoch, so the router's next question gets a snapshot (empty: nothing is cached).
    after = router_index_reaches(
        stack, stack.prefill.url, lambda i: i["snapshots"] > before["snapshots"] and i["pages"] == 0, "a snapshot"
    )
    assert after["state"] == "ok"
