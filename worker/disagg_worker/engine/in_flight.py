"""Steps in flight and the pages they write: what may reuse a page when.

Steps run strictly in order (`runner.ModelRunner`), so a page freed while a step is in flight may be
given to a later step at once. Nothing else may have it yet: a KV transfer (prefill writing a prompt's KV
into decode's pages from another process, `engine/decode.py`) or a load from host memory
(`engine/tiers.py`) writes a page outside that order, and a step still in flight that writes the page
afterwards overwrites what they wrote.

With overlap (`instance/loop.py`) that is the common case: step N+1 is scheduled before step N's tokens are
known, so a request that ends with step N (its EOS, a stop, an abort) is in step N+1 too, which writes the
KV of one more token into the request's last page. If that page were freed when step N ends, decode could
hand it to a prefill instance at once; the prompt KV prefill writes there is then overwritten by step N+1
in one slot, and the new request's answer differs from the monolithic one a few tokens in.

So a request in a step in flight keeps its pages until the last such step is processed (`defer`, then
`processed` hands it back to be released), and `written` names the pages the steps in flight write, for
the check where pages are taken (`Scheduler.take_pages`).
"""

from __future__ import annotations

import logging

from disagg_worker.engine.batch import ScheduledBatch
from disagg_worker.engine.request import Req

log = logging.getLogger(__name__)


class InFlight:
    """The batches scheduled and not yet processed, and the requests whose release waits for them."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.batches: list[ScheduledBatch] = []
        self._written: list[set[int]] = []  # per batch: the pages it writes
        self.held: list[Req] = []
        # Takes of pages a step in flight writes (`check_taken`): 0 unless this module's rule was broken.
        self.taken_while_written = 0

    def launched(self, batch: ScheduledBatch) -> None:
        self.batches.append(batch)
        self._written.append(set((batch.forward.out_slots // self.page_size).tolist()))

    def holds(self, req: Req) -> bool:
        """Whether a step in flight computes for `req` (and writes its pages)."""
        return any(r is req for b in self.batches for r in b.reqs)

    def defer(self, req: Req) -> None:
        """`req` ended while a step in flight computes for it: its pages are released once that step is."""
        self.held.append(req)

    def processed(self, batch: ScheduledBatch) -> list[Req]:
        """`batch`'s results are processed: the held requests no step in flight computes for any more. Steps end
        in order, so a batch launched before it whose results were never processed (none came back) ended too."""
        ends = next((i for i, b in enumerate(self.batches) if b is batch), -1)
        self.batches, self._written = self.batches[ends + 1 :], self._written[ends + 1 :]
        free = [r for r in self.held if not self.holds(r)]
        self.held = [r for r in self.held if self.holds(r)]
        return free

    def written(self) -> set[int]:
        """The pages the steps in flight write KV into."""
        return set().union(*self._written)

    def check_taken(self, pages: list[int] | None) -> None:
        """The check of the rule where pages leave the allocator: none a step in flight writes (counted and logged
        if one is: what the taker writes there, that step overwrites)."""
        if not pages or not self.batches:
            return
        clash = self.written().intersection(pages)
        if clash:
            self.taken_while_written += 1
            log.error("pages %s taken while a step in flight writes them", sorted(clash))
