"""The KV tiers on real processes and a real Mooncake Store (its master and a store server).

- A page the store holds under a name holds exactly the KV of that name's token prefix, whatever was inserted,
  evicted and written before (a property over random workloads, on a radix cache, a host tier and the store).
- Through P/D, with host tiers on both sides and the store under prefill, every answer, greedy and seeded, equals a
  monolithic server's without tiers, before and after prefill's cache is flushed down to host memory.
- A new instance on the same store computes only what the store lacks of a prompt another instance computed.
- A page changed in the store (through a real client, as anyone who reaches the store's master can) fails its
  tag: the instance reading it drops it, counts it, computes those tokens again and answers as monolithic.
- `kill -9` of the store's master while requests run costs only recompute: every answer equal, none failed; the
  store, started again, is written again.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
import requests
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mooncake.store import MooncakeDistributedStore

from disagg_worker import keys
from disagg_worker.engine.tiers import KVTiers
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.host_tier import HostTier
from disagg_worker.mem.kv_events import page_hashes
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.page_tag import TAG_BYTES, PageSeal
from disagg_worker.mem.radix import RadixCache
from disagg_worker.mem.store import MooncakeStore
from disagg_worker.tier_config import TierConfig
from tests.integration.kvstore import KVStore
from tests.integration.procs import PDStack, Proc, Stream, idle_now, report_after, scaled, serve, wait_until

pytestmark = pytest.mark.integration
PAGE = 4
FLAGS = ("--page-size", str(PAGE), "--chunk-size", "32", "--max-total-tokens", "512")
TIERS = ("--enable-hierarchical-cache", "--hicache-ratio", "4")


@pytest.fixture(scope="module")
def store():
    s = KVStore()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stack(tiny_model, store):
    pd = PDStack(
        tiny_model,
        *FLAGS,
        prefill_flags=(*TIERS, *store.flags()),
        decode_flags=TIERS,
        router_flags=("--verify-interval", "0"),
    ).wait_healthy()
    mono = serve(tiny_model, "--served-model-name", "tiny", *FLAGS).wait_healthy()
    yield pd, mono
    mono.stop()
    pd.stop()


# ---- the store holds each name's KV and nothing else ---------------------------------------------------------
def pool(pages: int) -> KVPool:
    return KVPool(num_layers=2, num_pages=pages, page_size=PAGE, num_kv_heads=1, head_dim=4, dtype=torch.float32)


@pytest.fixture(scope="module")
def client(store):
    seal = PageSeal(keys.store_tag_key(""), len(pool(1).page_bytes([0])))
    c = MooncakeStore(store.address, store.metadata, "127.0.0.1", "", seal)
    yield c
    c.close()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompts=st.lists(st.lists(st.integers(1, 3), min_size=PAGE, max_size=6 * PAGE), min_size=1, max_size=12),
    evictions=st.lists(st.integers(0, 8), min_size=12, max_size=12),
    policy=st.sampled_from(["write_through", "write_back"]),
)
def test_a_page_in_the_store_holds_exactly_the_kv_of_its_names_prefix(store, client, prompts, evictions, policy):
    p = pool(8)
    radix = RadixCache(PAGE, PageAllocator(8))
    # Keys of this example only: pages of another example under the same names hold other bytes on purpose.
    client.prefix = f"prop/{random.getrandbits(64):x}"
    cfg = TierConfig(enabled=True, write_policy=policy, storage_backend="mooncake", store_master=store.address)
    tiers = KVTiers(cfg, HostTier(p.buffers(), slots=3), radix, client)
    written: dict[int, bytes] = {}  # name -> the KV of its prefix (here a function of the name alone)
    try:
        for prompt, evict in zip(prompts, evictions, strict=False):
            tokens = prompt[: len(prompt) // PAGE * PAGE]
            names = page_hashes(tokens, PAGE)
            match = radix.match_prefix(tokens)
            radix.lock(match.node)
            fresh = radix.allocator.alloc(len(names) - len(match.pages))
            if fresh is None:
                radix.evict(len(names))
                fresh = radix.allocator.alloc(len(names) - len(match.pages)) or []
            radix.unlock(match.node)
            pages = list(match.pages) + fresh
            for name, page in list(zip(names, pages, strict=False))[len(match.pages) :]:  # "compute" the pages
                for b in p.buffers():
                    b[page].copy_(torch.rand(b[page].shape, generator=torch.Generator().manual_seed(name >> 1)))
                written.setdefault(name, p.page_bytes([page]))
            radix.allocator.free(radix.insert(tokens[: len(pages) * PAGE], pages))
            radix.evict(evict)
        radix.evict(radix.total_pages)  # everything down: host memory, and the store as it fills
        tiers.settle()
        assert client.connect()
        held = {n for n in written if client.exists([n]) == 1}
        # write_through: every page was written; write_back: every page host memory let go.
        assert held >= (set(written) if policy == "write_through" else set(written) - tiers.host.names())
        for name in held:
            assert client.get([name]) == [written[name]], f"page {name:016x} holds another prefix's KV"
    finally:
        tiers.close(close_store=False)  # the client serves every example


# ---- answers through P/D -------------------------------------------------------------------------------------
def run(url: str, ids: list[int], n: int = 10, seed: int | None = None) -> list[int]:
    params = {"max_new_tokens": n, "temperature": 0 if seed is None else 1.0, "ignore_eos": True}
    if seed is not None:
        params["seed"] = seed
    r = requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": params}, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def conversation(start: int, turns: int = 3) -> list[list[int]]:
    """Prompts of a growing conversation: each turn extends the last by 37 tokens."""
    rng = random.Random(start)
    history: list[int] = []
    out = []
    for _ in range(turns):
        history = history + [rng.randrange(10, 1500) for _ in range(37)]
        out.append(list(history))
    return out


def computed(proc: Proc) -> int:
    return requests.get(f"{proc.url}/stats", timeout=scaled(5)).json()["prompt_tokens_computed"]


def test_through_pd_with_tiers_every_answer_equals_monolithic_before_and_after_a_flush(stack):
    pd, mono = stack
    prompts = conversation(1) + conversation(2)
    want = [(run(mono.url, p), run(mono.url, p, seed=7)) for p in prompts]
    assert [(run(pd.router.url, p), run(pd.router.url, p, seed=7)) for p in prompts] == want
    idle_now(pd.prefill.url)
    loaded = tier_pages(pd.prefill, "loaded_host")
    requests.post(f"{pd.prefill.url}/flush_cache", timeout=scaled(5)).raise_for_status()  # down to host memory
    report_after(pd.prefill.url, 0, lambda s: s["cache_pages"] == 0, 20, "an empty prefix cache")
    before = computed(pd.prefill)
    assert [(run(pd.router.url, p), run(pd.router.url, p, seed=7)) for p in prompts] == want
    wait_until(lambda: tier_pages(pd.prefill, "loaded_host") > loaded, 10, what="pages loaded from host memory")
    # Each prompt computes at most its last partial page and the page after the cache's match, twice (two runs).
    assert computed(pd.prefill) - before <= 2 * sum(len(p) % PAGE + PAGE for p in prompts)


def fresh_instance(tiny_model, store):
    """A new monolithic instance on the same store, whose reads wait until the store's pages are in."""
    flags = ("--served-model-name", "tiny", *FLAGS, *TIERS, *store.flags())
    return serve(tiny_model, *flags, "--hicache-storage-prefetch-policy", "wait_complete").wait_healthy()


def test_a_new_instance_on_the_same_store_computes_only_what_the_store_lacks(stack, store, tiny_model):
    pd, mono = stack
    turns = conversation(3, turns=2)
    assert run(pd.router.url, turns[0]) == run(mono.url, turns[0])
    names = len(turns[0]) // PAGE
    wait_until(lambda: written(pd.prefill) >= names, 30, what="prefill writing the first turn to the store")
    fresh = fresh_instance(tiny_model, store)
    try:
        assert run(fresh.url, turns[1]) == run(mono.url, turns[1])
        new_tokens = len(turns[1]) - names * PAGE
        assert computed(fresh) <= new_tokens
    finally:
        fresh.stop()


def store_keys(store: KVStore) -> list[str]:
    """Every key the store holds, as its master lists them to anyone who asks (its HTTP port, unauthenticated)."""
    r = requests.get(f"http://127.0.0.1:{store.metrics}/get_all_keys", timeout=scaled(5))
    r.raise_for_status()
    return r.text.split()


@contextlib.contextmanager
def raw_client(store: KVStore) -> Iterator[MooncakeDistributedStore]:
    """A client of the store's own, as anyone who reaches its master may set up."""
    c = MooncakeDistributedStore()
    assert c.setup("127.0.0.1", store.metadata, 0, 16 << 20, "tcp", "", store.address) == 0
    try:
        yield c
    finally:
        c.close()


def rejected_pages(proc: Proc) -> float:
    """The instance's `disagg_kv_store_pages_rejected_total`, every reason's together."""
    lines = requests.get(f"{proc.url}/metrics", timeout=scaled(5)).text.splitlines()
    return sum(float(ln.split()[-1]) for ln in lines if ln.startswith("disagg_kv_store_pages_rejected_total"))


def test_a_page_tampered_in_the_store_is_computed_again_and_the_answer_equals_monolithic(stack, store, tiny_model):
    pd, mono = stack
    prompt = conversation(40, turns=2)[1]
    want = run(mono.url, prompt)
    assert run(pd.router.url, prompt) == want
    names = page_hashes(prompt[: len(prompt) // PAGE * PAGE], PAGE)  # prefill has no secret: unkeyed names

    def keys_of_prompt() -> list[str]:
        by_name = {k.rpartition("/")[2]: k for k in store_keys(store) if k.startswith("disagg/")}
        return [by_name[f"{n:016x}"] for n in names if f"{n:016x}" in by_name]

    wait_until(lambda: len(keys_of_prompt()) == len(names), 30, what="prefill writing the prompt to the store")
    tampered = 5
    key = keys_of_prompt()[tampered]
    with raw_client(store) as c:
        value = bytes(b ^ 0xFF for b in c.get(key))  # every bit flipped, the length kept
        assert c.upsert(key, value) == 0
        assert bytes(c.get(key)) == value
        fresh = fresh_instance(tiny_model, store)
        try:
            assert run(fresh.url, prompt) == want
            wait_until(lambda: rejected_pages(fresh) >= 1, 10, what="the tampered page counted as rejected")
            assert computed(fresh) >= len(prompt) - tampered * PAGE  # from the tampered page on: computed
            # Dropped from the store, so the page computed again is written in its place.
            seal = PageSeal(keys.store_tag_key(""), len(value) - TAG_BYTES)
            wait_until(lambda: seal.open(key, bytes(c.get(key))) is not None, 10, what="the page written again")
        finally:
            fresh.stop()


def tier_pages(proc: Proc, op: str) -> float:
    """The instance's `disagg_kv_tier_pages_total` for `op`, as its last report has it (every half second)."""
    text = requests.get(f"{proc.url}/metrics", timeout=scaled(5)).text
    line = next((ln for ln in text.splitlines() if ln.startswith(f'disagg_kv_tier_pages_total{{op="{op}"}}')), "")
    return float(line.split()[-1]) if line else 0.0


def written(proc: Proc) -> float:
    return tier_pages(proc, "written_store")


def completion(url: str, ids: list[int], n: int) -> Stream:
    body = {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    return Stream(url, "/v1/completions", body, timeout=scaled(120))


def text(s: Stream) -> str:
    return "".join(e["choices"][0]["text"] for e in s.events if isinstance(e, dict) and e.get("choices"))


def test_kill_9_of_the_stores_master_costs_only_recompute_and_the_store_fills_again(stack, store):
    pd, mono = stack
    prompts = [conversation(10 + i, turns=1)[0] for i in range(2)]
    want = [completion(mono.url, p, 200) for p in prompts]
    streams = [completion(pd.router.url, p, 200) for p in prompts]
    for s in streams:
        assert s.started.wait(scaled(60))
    running = sum(not s.done for s in streams)
    store.kill_master()  # while the streams decode and prefill's store thread may be writing their pages
    for s in [*want, *streams]:
        s.join(scaled(120))
    assert running and all(s.done and not s.error_events for s in streams)
    assert [text(s) for s in streams] == [text(s) for s in want]
    later = conversation(20)  # the store gone: every look-up and write fails, the prompts are computed
    assert [run(pd.router.url, p) for p in later] == [run(mono.url, p) for p in later]
    before = written(pd.prefill)
    store.start()  # the master again; the store server, still up, mounts its memory there again
    fresh = iter(range(30, 1000))

    def fills_again() -> bool:
        again = conversation(next(fresh), turns=1)[0]  # new pages for prefill to write
        assert run(pd.router.url, again) == run(mono.url, again)
        return written(pd.prefill) > before

    wait_until(fills_again, 60, interval=1, what="prefill writing to the store again")
