"""KV events on real processes: the router's index of the prefill instance's prefix cache equals what the
instance holds after requests, after a flush, and after the instance restarts (a new epoch: a snapshot); with
two prefill instances, the cache-aware router sends follow-ups sharing a prefix to the one that caches it, with
answers equal to a monolithic server's."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from disagg_worker import keys
from disagg_worker.mem.kv_events import HASH_SCHEME, page_hashes
from tests.integration.procs import (
    FAST_FAILURE,
    PDStack,
    Proc,
    free_port,
    idle_now,
    report_after,
    scaled,
    serve,
    wait_until,
)
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration
PAGE = 4
FLAGS = ("--page-size", str(PAGE), "--chunk-size", "32", "--max-total-tokens", "8192")


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, *FLAGS, router_flags=("--policy", "cache_aware", "--tokenizer", tiny_model)).wait_healthy()
    yield s
    s.stop()


def held(url: str) -> tuple[dict, set[int]]:
    """An instance's /kv_events snapshot: its header and the names of the pages it holds."""
    r = requests.get(f"{url}/kv_events", timeout=scaled(5))
    assert r.status_code == 200, r.text
    body = r.json()
    return body, pages_of(body)


def pages_of(body: dict) -> set[int]:
    """The names a snapshot lists, whichever attention group holds them."""
    return {int(n, 16) for names in body["snapshot"].values() for n in names}


def router_entry(router_url: str, worker_url: str) -> dict:
    body = requests.get(f"{router_url}/health", timeout=scaled(5)).json()
    return next(w for w in body["workers"] if w["url"] == worker_url)


def router_index_reaches(router_url: str, worker_url: str, pred, what: str) -> dict:
    deadline = time.monotonic() + scaled(15)
    while True:
        entry = router_entry(router_url, worker_url)
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

    index = router_index_reaches(
        stack.router.url, stack.prefill.url, lambda i: i["pages"] == len(names), f"{len(names)} pages"
    )
    assert index["state"] == "ok"
    assert "kv_index" not in router_entry(stack.router.url, stack.decode.url)  # decode caches no prompts: not polled

    requests.post(f"{stack.prefill.url}/flush_cache", timeout=scaled(5))
    header, names = settled(stack)
    assert names == set()
    router_index_reaches(stack.router.url, stack.prefill.url, lambda i: i["pages"] == 0, "the flush")


def test_a_restarted_prefill_instance_is_indexed_afresh(stack):
    generate(stack.router.url, varied_prompts(3)[2], n=2)
    before = router_index_reaches(stack.router.url, stack.prefill.url, lambda i: i["pages"] > 0, "the request's pages")
    port = int(stack.prefill.url.rsplit(":", 1)[1])
    stack.prefill.stop()
    stack.prefill = stack.start_prefill(port).wait_healthy()
    # A new process: a new epoch, so the router's next question gets a snapshot (empty: nothing is cached).
    after = router_index_reaches(
        stack.router.url,
        stack.prefill.url,
        lambda i: i["snapshots"] > before["snapshots"] and i["pages"] == 0,
        "a snapshot",
    )
    assert after["state"] == "ok"


@pytest.fixture(scope="module")
def two_prefills(tiny_model):
    """Two prefill instances, a decode and a cache-aware router, plus a monolithic server to compare answers."""
    flags = ["--served-model-name", "tiny", *FLAGS, *FAST_FAILURE]
    prefills = []
    for _ in range(2):
        port, bootstrap = free_port(), free_port()
        args = ["prefill", "--model", tiny_model, "--port", str(port), "--bootstrap-port", str(bootstrap), *flags]
        prefills.append((Proc(args, port), bootstrap))
    decode_port = free_port()
    decode = Proc(["decode", "--model", tiny_model, "--port", str(decode_port), *flags], decode_port)
    mono = serve(tiny_model, "--served-model-name", "tiny", *FLAGS)
    port = free_port()
    targets = [a for p, b in prefills for a in ("--prefill", p.url, str(b))]
    router_args = ["--policy", "cache_aware", "--tokenizer", tiny_model, "--health-interval", "0.5"]
    router = Proc(
        ["router", "--port", str(port), "--served-model-name", "tiny", *targets, "--decode", decode.url, *router_args],
        port,
    )
    procs = [router, decode, mono, *(p for p, _ in prefills)]
    try:
        for p in reversed(procs):
            p.wait_healthy()
        yield router, [p for p, _ in prefills], mono
    finally:
        for p in procs:
            p.stop()


def hit_tokens(url: str) -> int:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()["cache_hit_tokens"]


def test_cache_aware_routing_sends_a_shared_prefix_where_it_is_cached(two_prefills):
    router, prefills, mono = two_prefills
    system = list(range(300, 300 + 64))  # 16 pages
    first = generate(router.url, system + [7, 8], n=6)
    holder = caching(prefills, set(page_hashes(system, PAGE)))
    router_index_reaches(router.url, holder.url, lambda i: i["state"] == "ok" and i["pages"] > 0, "the prefix's pages")
    other = next(p for p in prefills if p is not holder)
    before = {p.url: hit_tokens(p.url) for p in prefills}
    for suffix in ([9, 10, 11], [12], [13, 14]):
        ids = system + suffix
        assert generate(router.url, ids, n=6) == generate(mono.url, ids, n=6)
    # Every follow-up ran where the prefix was: its 64 tokens came from that cache, none from the other's.
    report_after(
        holder.url,
        time.time(),
        lambda st: st["cache_hit_tokens"] >= before[holder.url] + 3 * 64,
        scaled(10),
        "the three follow-ups' cache hits",
    )
    assert hit_tokens(other.url) == before[other.url]
    routing = requests.get(f"{router.url}/health", timeout=scaled(5)).json()["routing"]
    assert routing.get("cache_hit", 0) >= 3, routing
    assert first == generate(mono.url, system + [7, 8], n=6)


def caching(prefills: list[Proc], names: set[int]) -> Proc:
    """The prefill instance whose cache holds `names` (once its report has reached its HTTP process)."""
    deadline = time.monotonic() + scaled(10)
    while True:
        found = [p for p in prefills if held(p.url)[1] >= names]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no prefill instance cached the prompt"
        time.sleep(0.2)


def test_with_the_models_secret_a_reader_cannot_name_a_prompts_pages_but_the_router_can(tiny_model, tmp_path):
    secret = tmp_path / "auth-token"
    secret.write_text("the-models-secret\n")
    router_flags = ("--policy", "cache_aware", "--tokenizer", tiny_model, "--auth-token-file", str(secret))
    stack = PDStack(tiny_model, *FLAGS, "--auth-token-file", str(secret), router_flags=router_flags).wait_healthy()
    key, key_id = keys.kv_names("the-models-secret")
    worker = {"Authorization": f"Bearer {keys.derive('the-models-secret', keys.WORKER)}"}
    try:
        system = list(range(500, 500 + 32))  # 8 pages
        generate(stack.router.url, system + [1], n=2)
        keyed = set(page_hashes(system, PAGE, key=key))

        def names() -> tuple[dict, set[int]] | None:
            r = requests.get(f"{stack.prefill.url}/kv_events", headers=worker, timeout=scaled(5))
            assert r.status_code == 200, r.text
            body = r.json()
            got = pages_of(body)
            return (body, got) if got >= keyed else None

        header, got = wait_until(names, timeout=10, what="the prompt's pages among the prefill's names")
        assert header["key_id"] == key_id
        assert not got & set(page_hashes(system, PAGE)), "names a reader could compute from a guessed prompt"
        router_index_reaches(stack.router.url, stack.prefill.url, lambda i: i["pages"] == len(got), "the pages")
        assert router_entry(stack.router.url, stack.prefill.url)["kv_index"]["state"] == "ok"
        # The router names the follow-up's pages with the same key: it scores the cached prefix.
        before = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()["routing"].get("cache_hit", 0)
        generate(stack.router.url, system + [2, 3], n=2)
        routing = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()["routing"]
        assert routing.get("cache_hit", 0) == before + 1, routing
    finally:
        stack.stop()
