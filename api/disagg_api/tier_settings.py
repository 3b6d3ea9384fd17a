"""The KV tiers' settings (part of `settings.ENGINE`): a host-memory tier under the prefix cache, and Mooncake
Store under it, shared by every instance of a model. SGLang's HiCache flags where it has them."""

from __future__ import annotations

from disagg_api.setting import Setting

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
STORAGE_BACKENDS = ("mooncake",)

ENABLE_HIERARCHICAL_CACHE = Setting(
    "--enable-hierarchical-cache",
    bool,
    False,
    help="keep the prefix cache's evicted pages in host memory (and in --hicache-storage-backend) and load them "
    "back on a hit instead of computing them again",
    sglang="--enable-hierarchical-cache",
)
HICACHE_RATIO = Setting(
    "--hicache-ratio",
    float,
    2.0,
    help="the host tier's pages as a multiple of the KV pool's (when --hicache-size is 0)",
    sglang="--hicache-ratio",
)
HICACHE_SIZE = Setting(
    "--hicache-size",
    float,
    0.0,
    help="the host tier's size in GB (0: --hicache-ratio)",
    sglang="--hicache-size",
)
HICACHE_WRITE_POLICY = Setting(
    "--hicache-write-policy",
    default="write_through",
    choices=WRITE_POLICIES,
    help="write_through: a page goes down when the prefix cache takes it; write_through_selective: once it is "
    "hit again; write_back: when it is evicted from the tier above",
    sglang="--hicache-write-policy",
)
HICACHE_STORAGE_BACKEND = Setting(
    "--hicache-storage-backend",
    choices=("", *STORAGE_BACKENDS),
    help="mooncake: Mooncake Store under the host tier, shared by every instance of the model (needs "
    "--hicache-store-master)",
    sglang="--hicache-storage-backend",
)
HICACHE_STORAGE_PREFETCH_POLICY = Setting(
    "--hicache-storage-prefetch-policy",
    default="best_effort",
    choices=PREFETCH_POLICIES,
    help="a request whose prefix is in the store: best_effort: is scheduled with what has arrived; "
    "wait_complete: waits for all of it; timeout: waits at most --hicache-storage-prefetch-timeout",
    sglang="--hicache-storage-prefetch-policy",
)
HICACHE_STORAGE_PREFETCH_TIMEOUT = Setting(
    "--hicache-storage-prefetch-timeout",
    float,
    2.0,
    help="seconds a request waits for its prefetch under the timeout policy; also the longest any store call "
    "may take before the store counts as down (recompute, retried later)",
)
HICACHE_STORE_MASTER = Setting(
    "--hicache-store-master",
    help="Mooncake Store's master, host:port (SGLang: MOONCAKE_MASTER)",
)
HICACHE_STORE_METADATA_SERVER = Setting(
    "--hicache-store-metadata-server",
    help="the store's metadata service (default: http://<master host>:8080/metadata, the master's own)",
)

TIERS = (
    ENABLE_HIERARCHICAL_CACHE,
    HICACHE_RATIO,
    HICACHE_SIZE,
    HICACHE_WRITE_POLICY,
    HICACHE_STORAGE_BACKEND,
    HICACHE_STORAGE_PREFETCH_POLICY,
    HICACHE_STORAGE_PREFETCH_TIMEOUT,
    HICACHE_STORE_MASTER,
    HICACHE_STORE_METADATA_SERVER,
)
