"""What cache-aware routing knows of a prompt and of the workers' prefix caches: the prompt's pages (`Prompt`),
and how many of its tokens a worker would compute (`PrefixScore.uncached`), from the router's index of the
workers' caches (`router/kv_index.py`), with the knobs and the counter of the choices made by them.

Pure: no HTTP, no clock but the index's own staleness (a worker whose index is not usable counts as holding
nothing).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

from disagg_worker.router.kv_index import KVIndex
from disagg_worker.router.worker import Worker

# What a prompt's page found below a worker's cache saves, as a share of one found in it (which saves its whole
# compute): a page in host memory costs a copy over PCIe (on a GPU, ~20% of computing it for an 8B model), one in
# the store a read over the network (~40%); on a CPU both are far cheaper than compute, so these under-count there.
HOST_HIT = 0.8
STORE_HIT = 0.6


@dataclass(frozen=True)
class Prompt:
    """What the router knows of a request's prompt: its length and the names of its whole pages."""

    tokens: int
    names: list[int]
    page_size: int


@dataclass
class PrefixScore:
    """The index a policy scores prompts by, cache_aware's knobs, and the count of its choices.

    One object shared by the pool, its policy and the DP-group choice (`groups.py`), so that a knob set on the
    pool is what the next pick reads and every choice lands in the one counter /health and /metrics show.
    """

    index: KVIndex = field(default_factory=KVIndex)
    # cache_aware's choices so far, by kind ("cache_hit", "load", "balanced", "decode_only"): /health's
    # "routing" and /metrics' disagg_router_cache_aware_decisions.
    decisions: collections.Counter[str] = field(default_factory=collections.Counter)
    # The guard: while some prefill worker (or attention group) is idle, one with this many prompt tokens
    # pending takes no more (--cache-aware-balance-tokens).
    balance_tokens: int = 4096
    # Conditional disaggregation's threshold (--decode-only-tokens; 0: every request goes through a prefill).
    decode_only_tokens: int = 0

    def uncached(self, w: Worker, prompt: Prompt | None) -> int:
        """Prompt tokens `w` would compute (at least one: the last token always runs); 0 without a prompt."""
        if prompt is None:
            return 0
        now = time.monotonic()
        cached = self.index.cached_pages(w.url, prompt.names, now)
        host, store = self.index.tiers(w.url, prompt.names, cached, now)
        hit = (cached + HOST_HIT * host + STORE_HIT * store) * prompt.page_size
        return max(prompt.tokens - int(hit), 1)

    def group_uncached(self, w: Worker, prompt: Prompt, groups: int) -> dict[int, int]:
        """Under DP attention, the prompt tokens each of `w`'s attention groups would compute (its own cache)."""
        now = time.monotonic()
        hit = {g: self.index.cached_pages(w.url, prompt.names, now, g) * prompt.page_size for g in range(groups)}
        return {g: max(prompt.tokens - hit[g], 1) for g in hit}
