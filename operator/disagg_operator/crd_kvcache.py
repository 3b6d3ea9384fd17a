"""Schema of `spec.kvCache`: the host-memory KV tier of each worker role and the model's Mooncake Store."""

from disagg_api import tier_settings as T

from . import names
from .schema import QUANTITY, obj, rule, string

KV_CACHE_RULES: list[tuple[str, str, str]] = [
    (
        "spec.kvCache",
        f"!has(self.{r}) || !(has(self.{r}.hostRatio) && has(self.{r}.hostSize))",
        f"set at most one of kvCache.{r}.hostRatio and kvCache.{r}.hostSize (hostSize wins in the worker, so "
        "the other would mislead)",
    )
    for r in names.WORKER_ROLES
] + [
    (
        "spec.kvCache",
        "!has(self.store) || !self.store.memory.matches('^0+(\\\\.0+)?[A-Za-z]*$')",
        "kvCache.store.memory must be above 0: it is the whole of the store's capacity",
    ),
]


def _rules_at(where: str) -> list[dict]:
    return [rule(expression, message) for w, expression, message in KV_CACHE_RULES if w == where]


def _host_tier(role: str) -> dict:
    ratio = {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 1000,
        "description": f"The host tier's pages as a multiple of a {role} worker's KV pool (default "
        f"{T.HICACHE_RATIO.default:g}; `--hicache-ratio`). Its bytes follow the model's KV size: include them in "
        f"{role}.resources' memory.",
    }
    size = string(
        f"The host tier's size per {role} worker, e.g. 16Gi (`--hicache-size`); added to the memory request and "
        f"limit set in {role}.resources.",
        16,
        pattern=QUANTITY,
    )
    return obj({"hostRatio": ratio, "hostSize": size}, f"The host tier of each {role} worker: a ratio or a size.")


def _store() -> dict:
    timeout = {
        "type": "number",
        "minimum": 0,
        "exclusiveMinimum": True,
        "maximum": 600,
        "description": "Seconds a request waits for its prefetch under prefetchPolicy timeout; also the longest a "
        f"store call may take before the worker counts the store as down (default "
        f"{T.HICACHE_STORAGE_PREFETCH_TIMEOUT.default:g}).",
    }
    return obj(
        {
            "memory": string(
                "The store's capacity, held by the store pod (one segment of mooncake_client), e.g. 4Gi; the pod "
                "requests it plus 1Gi for its two processes. Workers contribute none.",
                16,
                pattern=QUANTITY,
            ),
            "prefetchPolicy": string(
                "A request whose prefix is in the store: best_effort: scheduled with what has arrived; "
                "wait_complete: waits for all of it; timeout: waits at most prefetchTimeoutSeconds.",
                32,
                enum=list(T.PREFETCH_POLICIES),
                default=T.HICACHE_STORAGE_PREFETCH_POLICY.default,
            ),
            "prefetchTimeoutSeconds": timeout,
        },
        "Mooncake Store under the host tiers, shared by every worker of the model: the operator runs it as "
        "<model>-kvstore (a Deployment of one pod, a Service, a NetworkPolicy) and removes it when this goes. "
        "Pages in it outlast worker restarts and rollouts; when its pod is gone the workers compute again.",
        required=["memory"],
    )


def kv_cache_schema() -> dict:
    return obj(
        {
            names.PREFILL: _host_tier(names.PREFILL),
            names.DECODE: _host_tier(names.DECODE),
            "writePolicy": string(
                "When a page goes down a tier: write_through: when the prefix cache takes it; "
                "write_through_selective: once it is hit again; write_back: when it is evicted from the tier above.",
                32,
                enum=list(T.WRITE_POLICIES),
                default=T.HICACHE_WRITE_POLICY.default,
            ),
            "store": _store(),
        },
        "KV tiers under every worker's prefix cache: host memory (`--enable-hierarchical-cache`) and, with store, "
        "Mooncake Store. Absent: neither.",
        rules=_rules_at("spec.kvCache"),
    )
