"""The store under host memory: a page host memory held when a request arrived, and dropped while the request
waited, is read from the store at admission rather than computed again."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from disagg_worker.engine.tiers import KVTiers
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.host_tier import HostTier
from disagg_worker.mem.kv_events import page_hashes
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.radix import RadixCache
from disagg_worker.tier_config import TierConfig

PS = 4


class DictStore:
    """MooncakeStore's calls, in memory."""

    def __init__(self) -> None:
        self.kv: dict[int, bytes] = {}

    def exists(self, names: Sequence[int]) -> int:
        n = 0
        while n < len(names) and names[n] in self.kv:
            n += 1
        return n

    def get(self, names: Sequence[int]) -> list[bytes]:
        return [self.kv[n] for n in names]

    def put(self, names: Sequence[int], values: Sequence[bytes]) -> bool:
        self.kv.update(zip(names, values, strict=True))
        return True

    def close(self) -> None:
        pass


def test_pages_host_memory_dropped_while_a_request_waited_come_from_the_store_at_admission():
    pool = KVPool(num_layers=2, num_pages=16, page_size=PS, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    radix = RadixCache(PS, PageAllocator(16))
    store = DictStore()
    cfg = TierConfig(enabled=True, storage_backend="mooncake", store_master="store:1", prefetch_policy="wait_complete")
    tiers = KVTiers(cfg, HostTier(pool.buffers(), 4), radix, store)  # type: ignore[arg-type]
    try:
        a = list(range(100, 116))  # 4 pages: cached, then in host memory and the store
        radix.insert(a, radix.allocator.alloc(4))
        radix.evict(4)
        tiers.settle()  # the store's writer thread has written them
        assert store.exists(page_hashes(a, PS)) == 4
        tiers.prefetch("r", [*a, 1, 2, 3, 4, 5])  # arrives while host memory holds its pages
        tiers.settle()  # its first read (the page past them, which the store lacks) is done: "r" is ready
        assert tiers.ready("r")
        b = list(range(200, 216))  # another request's pages take every slot before "r" is admitted
        radix.insert(b, radix.allocator.alloc(4))
        assert tiers.host.run_of(page_hashes(a, PS)) == 0
        assert not tiers.admit("r", a, radix.allocator.alloc)  # waits for its second read (wait_complete)
        tiers.settle()
        assert tiers.admit("r", a, radix.allocator.alloc)
        assert radix.match_prefix(a).num_tokens == 16 and tiers.stats.fetched_store == 4
    finally:
        tiers.close()


def test_a_request_waiting_for_the_store_lets_those_behind_it_in(tiny_model):
    """wait_complete holds only the request whose read is under way, not the queue behind it."""
    from disagg_worker.config import CacheConfig, EngineConfig, SchedulerConfig
    from disagg_worker.engine.assemble import load_engine
    from disagg_worker.request import messages as msg
    from tests.unit.test_engine import GREEDY

    cfg = TierConfig(enabled=True, storage_backend="mooncake", store_master="store:1", prefetch_policy="wait_complete")
    engine = load_engine(
        EngineConfig(
            model_path=tiny_model,
            cache=CacheConfig(page_size=PS, max_total_tokens=256, tiers=cfg),
            scheduler=SchedulerConfig(chunk_size=16),
        )
    )
    tiers = engine.tiers
    assert tiers is not None
    tiers.close(close_store=False)  # no store threads: the read of "slow" never ends
    tiers.store = DictStore()  # type: ignore[assignment]
    slow = list(range(300, 332))
    tiers.store.put(page_hashes(slow, PS), [b""] * 8)
    engine.handle(msg.GenerateReq("slow", slow + [5], GREEDY))
    engine.handle(msg.GenerateReq("fast", [600, 601, 602], GREEDY))  # under a page: nothing to read
    batch = engine.scheduler.schedule()
    assert batch is not None and [r.rid for r in batch.reqs] == ["fast"]
    assert [r.rid for r in engine.scheduler.waiting] == ["slow"]
