"""`spec.kvCache`: the KV tiers under each worker's prefix cache, as the builders need them.

A host-memory tier on every prefill and decode worker (`--enable-hierarchical-cache`), sized per role as a multiple
of the role's KV pool (`hostRatio`) or in bytes (`hostSize`), and, with `store`, Mooncake Store under it: one
store pod per model whose memory holds the pages every worker writes down (builders/kvstore.py).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from disagg_api import tier_settings as T

from .quantity import to_bytes

DEFAULT_HOST_RATIO = T.HICACHE_RATIO.default


@dataclass(frozen=True)
class HostTier:
    """One role's host tier: `size_bytes` when given (`hostSize`), else `ratio` times the role's KV pool."""

    ratio: float = DEFAULT_HOST_RATIO
    size_bytes: int | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "HostTier":
        d = d or {}
        size = d.get("hostSize")
        return cls(float(d.get("hostRatio", DEFAULT_HOST_RATIO)), to_bytes(str(size)) if size is not None else None)

    @property
    def size_gb(self) -> float | None:
        """What `--hicache-size` takes: GB of 10^9 bytes."""
        return self.size_bytes / 1e9 if self.size_bytes is not None else None


@dataclass(frozen=True)
class StoreSpec:
    """Mooncake Store for the model: the store pod's memory (its one segment) and how workers prefetch from it."""

    memory: str
    prefetch_policy: str = T.HICACHE_STORAGE_PREFETCH_POLICY.default
    prefetch_timeout_s: float = T.HICACHE_STORAGE_PREFETCH_TIMEOUT.default

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "StoreSpec | None":
        if d is None:
            return None
        return cls(
            str(d["memory"]),
            str(d.get("prefetchPolicy", T.HICACHE_STORAGE_PREFETCH_POLICY.default)),
            float(d.get("prefetchTimeoutSeconds", T.HICACHE_STORAGE_PREFETCH_TIMEOUT.default)),
        )

    @property
    def memory_bytes(self) -> int:
        return to_bytes(self.memory)


@dataclass(frozen=True)
class KVCacheSpec:
    prefill: HostTier
    decode: HostTier
    write_policy: str = T.HICACHE_WRITE_POLICY.default
    store: StoreSpec | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "KVCacheSpec | None":
        if d is None:
            return None
        return cls(
            HostTier.from_dict(d.get("prefill")),
            HostTier.from_dict(d.get("decode")),
            str(d.get("writePolicy", T.HICACHE_WRITE_POLICY.default)),
            StoreSpec.from_dict(d.get("store")),
        )

    def host(self, role: str) -> HostTier:
        return self.prefill if role == "prefill" else self.decode
