"""The host tier under the prefix cache: pages move down instead of vanishing, come back byte for byte, and a
request that finds its prefix there computes only the rest, with the answers of an instance without tiers."""

from __future__ import annotations

import pytest
import torch

from disagg_worker.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.engine.tiers import KVTiers
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.host_tier import HostTier
from disagg_worker.mem.kv_events import page_hashes
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.radix import RadixCache
from disagg_worker.model.tiny import make_tiny
from disagg_worker.request import messages as msg
from disagg_worker.speculative_config import SpeculativeConfig as Spec
from disagg_worker.tier_config import TierConfig
from tests.unit.test_engine import GREEDY, reference, run_all, tokens_of, varied_prompts  # noqa: F401

PS = 4


def pool(pages: int = 16) -> KVPool:
    return KVPool(num_layers=2, num_pages=pages, page_size=PS, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def fill(p: KVPool, page: int, value: float) -> None:
    for b in p.buffers():
        b[page].fill_(value)


def test_a_page_saved_and_evicted_from_the_pool_loads_back_byte_for_byte():
    p = pool()
    for page in range(4):
        fill(p, page, page + 0.5)
    host = HostTier(p.buffers(), slots=8)
    assert host.save([11, 12, 13], [1, 2, 3]) == [11, 12, 13]
    assert host.save([12], [0]) == []  # already there: kept as it was
    expected = p.page_bytes([1, 2, 3])
    for page in range(4):
        fill(p, page, -1.0)
    host.load([11, 12, 13], [5, 6, 7])
    assert p.page_bytes([5, 6, 7]) == expected
    assert host.run_of([11, 12, 99, 13]) == 2


def test_the_least_recently_used_page_leaves_first_with_its_bytes_and_pinned_pages_stay():
    p = pool()
    for page in range(6):
        fill(p, page, float(page))
    dropped: list[tuple[int, bytes]] = []
    host = HostTier(p.buffers(), slots=3, on_evict=lambda names, data: dropped.extend(zip(names, data, strict=True)))
    host.save([1, 2, 3], [1, 2, 3])
    host.run_of([1])  # 1 is used: 2 is now the oldest
    host.pin([2])
    host.save([4], [4])
    assert [n for n, _ in dropped] == [3] and dropped[0][1] == p.page_bytes([3])
    assert host.names() == {1, 2, 4}
    host.unpin([2])
    host.save([5], [5])
    assert host.names() == {1, 4, 5}


def tree(policy: str, pages: int = 16, slots: int = 32) -> tuple[KVPool, RadixCache, KVTiers]:
    p = pool(pages)
    radix = RadixCache(PS, PageAllocator(pages))
    tiers = KVTiers(TierConfig(enabled=True, write_policy=policy), HostTier(p.buffers(), slots), radix)
    return p, radix, tiers


def cache_tokens(p: KVPool, radix: RadixCache, tokens: list[int]) -> list[int]:
    pages = radix.allocator.alloc(len(tokens) // PS)
    for i, page in enumerate(pages):
        fill(p, page, float(tokens[i * PS]))
    assert radix.insert(tokens, pages) == []
    return pages


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_each_write_policy_writes_down_at_its_moment(policy):
    p, radix, tiers = tree(policy)
    tokens = list(range(100, 116))
    cache_tokens(p, radix, tokens)
    names = page_hashes(tokens, PS)
    assert len(tiers.host) == (4 if policy == "write_through" else 0)
    radix.match_prefix(tokens)  # a hit
    assert len(tiers.host) == (0 if policy == "write_back" else 4)
    radix.evict(radix.total_pages)
    assert tiers.host.run_of(names) == 4


def test_restore_puts_the_host_pages_past_the_cache_into_the_tree_and_the_match_finds_them():
    p, radix, tiers = tree("write_back")
    tokens = list(range(200, 232))  # 8 pages
    cache_tokens(p, radix, tokens)
    expected = p.page_bytes(radix.match_prefix(tokens).pages)
    radix.evict(radix.total_pages)
    assert radix.total_pages == 0 and radix.allocator.num_free == 16
    cache_tokens(p, radix, tokens[:8])  # the first two pages are cached again, the rest only in host memory
    assert tiers.restore(tokens + [1, 2], radix.allocator.alloc) == 6
    match = radix.match_prefix(tokens)
    assert match.num_tokens == 32 and p.page_bytes(match.pages) == expected
    assert tiers.restore(tokens, radix.allocator.alloc) == 0  # nothing more below
    assert radix.allocator.num_free + radix.total_pages == 16 and radix.total_refs() == 0


def test_restore_without_free_pages_loads_nothing_and_leaks_nothing():
    p, radix, tiers = tree("write_through", pages=4)
    tokens = list(range(300, 316))
    cache_tokens(p, radix, tokens)
    radix.evict(4)
    held = radix.allocator.alloc(4)
    assert tiers.restore(tokens, lambda n: None) == 0
    radix.allocator.free(held)
    assert radix.allocator.num_free == 4 and radix.total_pages == 0


def make_engine(model: str, tiers: TierConfig, tokens: int = 256, overlap: bool = True) -> Engine:
    cfg = EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=PS, max_total_tokens=tokens, tiers=tiers),
        scheduler=SchedulerConfig(chunk_size=16, enable_overlap=overlap),
    )
    return load_engine(cfg)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_instance_with_a_host_tier_answers_as_one_without_and_computes_only_what_host_memory_lacks(
    tiny_model,
    reference,  # noqa: F811
    policy,
):
    prompts, expected = reference
    engine = make_engine(tiny_model, TierConfig(enabled=True, ratio=8.0, write_policy=policy))
    first = run_all(engine, [(p, GREEDY) for p in prompts], overlap=True, flush=False)
    assert [tokens_of(first[str(i)]) for i in range(len(prompts))] == expected
    computed = engine.scheduler.prompt_tokens_computed
    engine.handle(msg.FlushCacheReq())  # the cache's pages all go down to host memory
    assert engine.radix.total_pages == 0
    again = run_all(engine, [(p, GREEDY) for p in prompts], overlap=True, flush=False)
    assert [tokens_of(again[str(i)]) for i in range(len(prompts))] == expected
    recomputed = engine.scheduler.prompt_tokens_computed - computed
    assert engine.tiers is not None and engine.tiers.stats.loaded_host > 0
    # Each prompt's whole pages before its last token come back: it computes its last partial page at most.
    assert recomputed <= sum(len(p) % PS + PS for p in prompts)
    assert sum(again[str(i)][-1].cached_tokens for i in range(len(prompts))) > 0


def test_retracted_requests_get_their_kv_back_from_host_memory_and_answer_the_same(tiny_model, reference):  # noqa: F811
    prompts, expected = reference
    engine = make_engine(tiny_model, TierConfig(enabled=True, ratio=4.0, write_policy="write_back"), tokens=160)
    out = run_all(engine, [(p, GREEDY) for p in prompts], overlap=True)
    assert [tokens_of(out[str(i)]) for i in range(len(prompts))] == expected
    assert engine.tiers is not None and engine.tiers.stats.loaded_host > 0


SEEDED = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11, ignore_eos=True)


def answers_twice(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy and seeded answers of `prompts`, then again after the prefix cache is flushed down to the tiers."""
    reqs = [(p, params) for p in prompts for params in (GREEDY, SEEDED)]
    out = []
    for flush in (True, False):
        got = run_all(engine, reqs, overlap=engine.cfg.overlap, flush=False)  # as the instance steps it
        out += [tokens_of(got[str(i)]) for i in range(len(reqs))]
        if flush:
            engine.handle(msg.FlushCacheReq())
    return out


def spec_config(model: str, spec: Spec, tiers: TierConfig) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=PS, max_total_tokens=1024, tiers=tiers),
        scheduler=SchedulerConfig(chunk_size=16, speculative=spec),
    )


@pytest.mark.parametrize("kind", ["mla", "draft_in_pool", "draft_own_pool"])
def test_mla_latents_and_draft_kv_come_back_from_host_memory_with_the_same_answers(tiny_model, tmp_path, kind):
    model, spec = tiny_model, Spec()
    if kind == "mla":
        model = str(make_tiny(tmp_path / "mla", arch="deepseek_v3"))
    else:  # a one-layer draft; of the model's KV shape it lives in the model's pool, else in one of its own
        draft = make_tiny(
            tmp_path / "draft",
            seed=3,
            num_kv_heads=2 if kind == "draft_in_pool" else 1,
            overrides={"num_hidden_layers": 1},
        )
        spec = Spec(algorithm="STANDALONE", draft_model_path=str(draft), num_steps=3)
    prompts = varied_prompts(6, seed=5)
    plain = answers_twice(load_engine(spec_config(model, spec, TierConfig())), prompts)
    engine = load_engine(spec_config(model, spec, TierConfig(enabled=True, write_policy="write_back")))
    assert answers_twice(engine, prompts) == plain
    assert engine.tiers is not None and engine.tiers.stats.loaded_host > 0
    own_pool = kind == "draft_own_pool"
    assert len(engine.tiers.host.host) == len(engine.kv_pool.buffers()) + (2 if own_pool else 0)
