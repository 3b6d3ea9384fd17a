"""Pages in Mooncake Store carry a keyed tag over their name and bytes: a page changed in the store, another name's
page, or one sealed under another key reads as a miss (dropped from the store and counted), so its tokens are
computed again; an intact page reads back byte for byte without its tag."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import REGISTRY

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

PS = 4
KEY = keys.store_tag_key("s3cret")


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("disagg_kv_store_pages_rejected_total", {"reason": reason}) or 0.0


def page(n: int, size: int = 64) -> bytes:
    return bytes((n + i) % 256 for i in range(size))


def test_a_sealed_page_opens_to_its_bytes_and_any_change_fails():
    seal = PageSeal(KEY, 64)
    value = seal.seal("p/0001", page(1))
    assert len(value) == 64 + TAG_BYTES
    assert seal.open("p/0001", value) == page(1)
    before = rejected("tag")
    for at in (0, 63, 64, len(value) - 1):  # a bit of the page or of the tag
        flipped = bytearray(value)
        flipped[at] ^= 0x01
        assert seal.open("p/0001", bytes(flipped)) is None
    assert rejected("tag") == before + 4


def test_another_names_page_and_another_keys_seal_fail():
    seal = PageSeal(KEY, 64)
    assert seal.open("p/0002", seal.seal("p/0001", page(1))) is None  # authentic, but not this name's
    assert seal.open("p/0001", PageSeal(keys.store_tag_key("other"), 64).seal("p/0001", page(1))) is None
    unkeyed = PageSeal(keys.store_tag_key(""), 64)  # no secret: a fixed key, which still catches a change
    assert unkeyed.open("p/0001", unkeyed.seal("p/0001", page(1))) == page(1)
    assert seal.open("p/0001", unkeyed.seal("p/0001", page(1))) is None


def test_a_value_of_the_wrong_length_fails_as_size():
    seal = PageSeal(KEY, 64)
    before = rejected("size")
    value = seal.seal("p/0001", page(1))
    for bad in (b"", value[:TAG_BYTES], value[:-1], value + b"\0", PageSeal(KEY, 32).seal("p/0001", page(1, 32))):
        assert seal.open("p/0001", bad) is None
    assert rejected("size") == before + 5


class FakeClient:
    """Mooncake's store client as `MooncakeStore` uses it, over a dict; `remove` refuses without force, as a
    real store does while a read's lease holds the key."""

    def __init__(self, data: dict[str, bytes]):
        self.data = data

    def setup(self, *args: object) -> int:
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if k in self.data else 0 for k in keys]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [self.data.get(k, b"") for k in keys]

    def put_batch(self, keys: list[str], values: list[bytes]) -> int:
        for k, v in zip(keys, values, strict=True):
            self.data.setdefault(k, bytes(v))  # a put under a key the store holds keeps the old value
        return 0

    def remove(self, key: str, force: bool = False) -> int:
        if not force:
            return -706
        return 0 if self.data.pop(key, None) is not None else -704

    def close(self) -> None:
        pass


def fake_store(data: dict[str, bytes], nbytes: int) -> MooncakeStore:
    return MooncakeStore("master", "meta", "127.0.0.1", "p", PageSeal(KEY, nbytes), lambda: FakeClient(data))


def test_the_store_reads_up_to_a_tampered_page_drops_it_and_takes_the_page_written_again():
    data: dict[str, bytes] = {}
    store = fake_store(data, 64)
    assert store.put([1, 2, 3], [page(1), page(2), page(3)])
    assert all(len(v) == 64 + TAG_BYTES for v in data.values())  # stored sealed
    assert store.get([1, 2, 3]) == [page(1), page(2), page(3)]  # opened: the pool gets no tag
    flipped = bytearray(data[store.key(2)])
    flipped[5] ^= 0x80  # the length kept
    data[store.key(2)] = bytes(flipped)
    before = rejected("tag")
    assert store.get([1, 2, 3]) == [page(1)]  # up to the tampered page: the rest is computed
    assert rejected("tag") == before + 1
    assert store.key(2) not in data  # dropped, so that the page computed again takes its place
    assert store.exists([1, 2, 3]) == 1
    assert store.put([2], [page(2)])
    assert store.get([1, 2, 3]) == [page(1), page(2), page(3)]


def pool(pages: int = 8) -> KVPool:
    return KVPool(num_layers=2, num_pages=pages, page_size=PS, num_kv_heads=1, head_dim=4, dtype=torch.float32)


@pytest.mark.parametrize("tampered", [0, 2])
def test_a_request_gets_from_the_store_only_the_pages_before_a_tampered_one(tampered):
    p = pool()
    host = HostTier(p.buffers(), slots=8)
    data: dict[str, bytes] = {}
    store = fake_store(data, host.page_nbytes)
    tokens = list(range(1, 4 * PS + 1))
    names = page_hashes(tokens, PS)
    store.put(names, [page(n, host.page_nbytes) for n in range(4)])
    flipped = bytearray(data[store.key(names[tampered])])
    flipped[-1] ^= 0x01
    data[store.key(names[tampered])] = bytes(flipped)
    cfg = TierConfig(enabled=True, storage_backend="mooncake", store_master="127.0.0.1:50051")
    tiers = KVTiers(cfg, host, RadixCache(PS, PageAllocator(8)), store)
    try:
        tiers.prefetch("r", tokens)
        tiers.settle()
        assert host.run_of(names) == tampered  # the tokens from the tampered page on are computed
        assert [host.page_bytes(n) for n in names[:tampered]] == [page(n, host.page_nbytes) for n in range(tampered)]
        assert tiers.stats.fetched_store == tampered
    finally:
        tiers.close()
