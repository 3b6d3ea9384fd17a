"""The KV tiers' part of the configuration chain (`config.py`: CacheConfig.tiers): a host-memory tier under the
prefix cache and, under it, Mooncake Store (`mem/tiers.py` builds them)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from disagg_api import tier_settings as T
from disagg_worker.errors import ConfigError
from disagg_worker.flags import from_flag

METADATA_PORT = 8080  # where mooncake_master serves its HTTP metadata service (--http_metadata_server_port)


@dataclass(frozen=True)
class TierConfig:
    enabled: bool = from_flag(T.ENABLE_HIERARCHICAL_CACHE)
    ratio: float = from_flag(T.HICACHE_RATIO)
    size_gb: float = from_flag(T.HICACHE_SIZE)
    write_policy: str = from_flag(T.HICACHE_WRITE_POLICY)
    storage_backend: str = from_flag(T.HICACHE_STORAGE_BACKEND)  # "": no store
    prefetch_policy: str = from_flag(T.HICACHE_STORAGE_PREFETCH_POLICY)
    prefetch_timeout: float = from_flag(T.HICACHE_STORAGE_PREFETCH_TIMEOUT)
    store_master: str = from_flag(T.HICACHE_STORE_MASTER)
    store_metadata_server: str = from_flag(T.HICACHE_STORE_METADATA_SERVER)

    def __post_init__(self) -> None:
        if self.storage_backend and not self.enabled:
            raise ConfigError(
                f"--hicache-storage-backend {self.storage_backend} sits under the host tier: pass "
                "--enable-hierarchical-cache too"
            )
        if self.storage_backend and not self.store_master:
            raise ConfigError(
                f"--hicache-storage-backend {self.storage_backend} needs --hicache-store-master host:port"
            )
        if self.store_master and not urlsplit(f"//{self.store_master}").port:
            raise ConfigError(f"--hicache-store-master {self.store_master}: host:port")
        if self.enabled and self.ratio <= 0 and self.size_gb <= 0:
            raise ConfigError(f"--hicache-ratio {self.ratio}: the host tier needs pages (or pass --hicache-size)")
        if self.prefetch_timeout <= 0:
            raise ConfigError(f"--hicache-storage-prefetch-timeout {self.prefetch_timeout}: seconds, above 0")

    @property
    def store(self) -> bool:
        return bool(self.storage_backend)

    @property
    def metadata_server(self) -> str:
        """The store's metadata service: the flag's, or the master's own HTTP one."""
        if self.store_metadata_server:
            return self.store_metadata_server
        return f"http://{urlsplit(f'//{self.store_master}').hostname}:{METADATA_PORT}/metadata"

    def host_pages(self, device_pages: int, page_bytes: int) -> int:
        """Pages the host tier holds: `--hicache-size` GB of pages of `page_bytes`, or the ratio of the pool's."""
        if self.size_gb > 0:
            return max(1, int(self.size_gb * 1e9) // page_bytes)
        return max(1, int(device_pages * self.ratio))
