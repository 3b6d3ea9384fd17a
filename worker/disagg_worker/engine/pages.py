"""The KV pages of the scheduler's requests: taken from the allocator (evicting the prefix cache's unused pages when
it runs short), claimed for a request's whole known sequence behind the prefix the cache holds, and given back.

The scheduler decides who gets pages and when (`engine/scheduler.py`, whose docstring states the page accounting
invariant); this is how they are taken and returned. `give_back` is the only way pages leave a request: whole
computed pages to the radix cache, the rest to the allocator.
"""

from __future__ import annotations

from disagg_worker.engine.in_flight import InFlight
from disagg_worker.engine.lora_registry import Resident
from disagg_worker.engine.prefix_tiers import Tiers
from disagg_worker.engine.request import Req
from disagg_worker.mem.allocator import PageAllocator, pages_for
from disagg_worker.mem.radix import RadixCache


def cacheable_prefix(req: Req) -> list[int]:
    """Tokens whose KV may come from the cache: not the last (it computes logits), none to score a prompt."""
    return req.cache_ids(req.seq_len - 1) if not req.params.prompt_logprobs else []


class RequestPages:
    def __init__(
        self,
        page_size: int,
        allocator: PageAllocator,
        radix: RadixCache,
        tiers: Tiers,
        in_flight: InFlight,
        adapters: Resident,
    ):
        self.page_size = page_size
        self.allocator = allocator
        self.radix = radix
        self.tiers = tiers
        self.in_flight = in_flight
        self.adapters = adapters

    def take(self, n: int) -> list[int] | None:
        """`n` free pages, evicting the prefix cache's unused ones if needed; None if there are not enough."""
        short = n - self.allocator.num_free
        if short > 0:
            self.radix.evict(short)
        pages = self.allocator.alloc(n)
        self.in_flight.check_taken(pages)
        return pages

    def needs(self, req: Req, n: int) -> int:
        """Pages `req` lacks for its next `n` tokens."""
        return max(0, pages_for(req.num_computed + n, self.page_size) - len(req.pages))

    def claim(self, req: Req, reserve: int) -> list[int] | None:
        """The pages of `req`'s whole known sequence: the prefix the cache holds (locked, before the last token's
        page; `req.prefix_node`, `prefix_pages`, `cached_tokens` set) then fresh ones, keeping `reserve` pages for
        the running requests; None, with nothing taken, when they do not fit."""
        prefix = cacheable_prefix(req)
        if not self.tiers.admit(req.rid, prefix, self.take):
            return None
        match = self.radix.match_prefix(prefix)
        self.radix.lock(match.node)
        need = pages_for(req.seq_len, self.page_size) - len(match.pages)
        pages = self.take(need) if self._room(need, reserve) else None
        if pages is None:
            self.radix.unlock(match.node)
            return None
        req.prefix_node, req.prefix_pages, req.cached_tokens = match.node, len(match.pages), match.num_tokens
        self.tiers.forget(req.rid)
        return list(match.pages) + pages

    def fits(self, req: Req, reserve: int) -> bool:
        """Whether `claim` would find room for `req` now beside `reserve` (what the host tiers hold of its prefix
        not counted); nothing taken."""
        match = self.radix.peek(cacheable_prefix(req))
        self.radix.lock(match.node)  # its pages are then not counted as evictable, as in `claim`
        fits = self._room(pages_for(req.seq_len, self.page_size) - len(match.pages), reserve)
        self.radix.unlock(match.node)
        return fits

    def _room(self, need: int, reserve: int) -> bool:
        return need + reserve <= self.allocator.num_free + self.radix.evictable_pages

    def give_back(self, req: Req) -> None:
        """Return `req`'s pages now: whole computed pages to the radix cache, the rest freed; its prefix unlocked,
        its adapter's slot released."""
        computed = min(req.num_computed, len(req.fill_ids))
        full = computed // self.page_size
        tokens = req.cache_ids(full * self.page_size)
        redundant = self.radix.insert(tokens, req.pages[:full])
        self.allocator.free(redundant + req.pages[full:])
        if req.prefix_node is not None:
            self.radix.unlock(req.prefix_node)
        req.prefix_node, req.pages, req.prefix_pages = None, [], 0
        self.adapters.release(req)
