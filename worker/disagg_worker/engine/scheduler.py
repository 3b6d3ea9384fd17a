"""Continuous batching over a paged KV cache.

Life of a request here: `add` puts it in the waiting queue (in `--scheduling-policy`'s order,
`engine/waiting.py`) -> `schedule` admits it when its whole prompt fits (prefix pages come from the
radix cache, the rest from the allocator, `engine/pages.py`) -> it is prefilled in chunks of at most
`chunk_size` tokens, mixed in the same forward with the decode steps of the running requests -> after
its last chunk each step samples one token (`process`), or several when a speculative draft was
verified with it (`engine/speculative.py`) -> on finish its full pages go into the radix cache and
the rest back to the allocator. A request marked `handoff`
(prefill in a P/D deployment) is instead handed back with its pages after its last token.

When pages run short for the running requests' next tokens, one of them is retracted (back to waiting with its
tokens, computed again once admitted again): the one the policy picks. Under priority, the first waiting request,
when it lacks a running slot or its pages, also preempts running ones of lower priority: they are retracted before
the step is planned, the lowest first, until it fits.

`process` returns what a step did (`StepOutcome`): a role stage acts on it without hooking in.

Page accounting invariant: a page is either free in the allocator, held by the radix cache, or in
exactly one request's private page table; `release` is the only way out of a request. A request that ends
while a step in flight computes for it keeps its pages until that step is processed (`engine/in_flight.py`):
only a later step may write a page before then, never a KV transfer or a load from host memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sized

from disagg_worker.config import SchedulerConfig
from disagg_worker.engine.batch import Plan, Sampled, ScheduledBatch, StepOutcome, StepResult, build_batch
from disagg_worker.engine.in_flight import InFlight
from disagg_worker.engine.lora_registry import Resident
from disagg_worker.engine.outbox import Outbox, TopLogprobs, internal_error
from disagg_worker.engine.pages import RequestPages, cacheable_prefix
from disagg_worker.engine.prefix_tiers import NoTiers, Tiers
from disagg_worker.engine.request import FinishReason, Req
from disagg_worker.engine.speculative import DraftPlanner
from disagg_worker.engine.waiting import waiting_queue
from disagg_worker.mem.allocator import PageAllocator, pages_for
from disagg_worker.mem.radix import RadixCache
from disagg_worker.request.errors import INTERNAL_ERROR

log = logging.getLogger(__name__)


def decode_reserve_pages(running: list[Req], reserve_tokens: int, page_size: int) -> int:
    """Pages kept free for the next decode steps of `running` before new prompts are admitted."""
    return sum(pages_for(min(r.remaining_new_tokens(), reserve_tokens), page_size) for r in running)


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        page_size: int,
        allocator: PageAllocator,
        radix: RadixCache,
        outbox: Outbox,
        future_inputs: bool = True,
        drafter: DraftPlanner | None = None,
        tiers: Tiers | None = None,
        incoming: Sized = (),
        adapters: Resident | None = None,
    ):
        """`future_inputs`: a request may be scheduled while its previous token is still being sampled (the runner
        fills it in); False with pipeline stages, where it is not back yet. `drafter`: proposes speculative drafts
        for decode steps (None: no speculation). `tiers`: host memory and the store under the prefix cache
        (engine/tiers.py). `incoming`: the requests another stage will hand to the running batch (decode's
        transfers), whose running slots are taken. `adapters`: the LoRA adapters resident (`lora_registry.py`)."""
        self.cfg = cfg
        self.drafter = drafter
        self.future_inputs = future_inputs
        self.page_size = page_size
        self.allocator = allocator
        self.radix = radix
        self.outbox = outbox
        self.waiting = waiting_queue(cfg.scheduling_policy)  # in the order of admission (`engine/waiting.py`)
        self.running: list[Req] = []
        self.by_rid: dict[str, Req] = {}
        self.step_count = 0
        self.prompt_tokens_computed = 0  # tokens of prompts computed before their first token (SchedulerStats)
        self.incoming = incoming
        self.tiers = tiers if tiers is not None else NoTiers()
        self.in_flight = InFlight(page_size)
        self.adapters = adapters if adapters is not None else Resident(0, 0)
        self.pages = RequestPages(page_size, allocator, radix, self.tiers, self.in_flight, self.adapters)

    # ---- queue changes -------------------------------------------------------------------
    def add(self, req: Req) -> None:
        if req.rid in self.by_rid:  # two requests under one id would share a page table
            self.outbox.reject(req, 400, f"request id {req.rid!r} is already in use")
            return
        self.by_rid[req.rid] = req
        self.waiting.add(req)
        self.tiers.prefetch(req.rid, cacheable_prefix(req))
        req.trail.begin("scheduler.waiting")

    def add_running(
        self, req: Req, pages: list[int], first_token: int, logprob: float | None, top: TopLogprobs | None = None
    ) -> None:
        """Start decoding a request whose prompt KV is already in `pages` (decode after a transfer)."""
        req.pages, req.num_computed = pages, len(req.prompt_ids)
        req.sampling.resume_after(first_token)  # prefill sampled it (its draw, its grammar step)
        self.by_rid[req.rid] = req
        self.running.append(req)
        self._accept(Sampled(req, first_token, logprob, top))

    def abort(self, rid: str) -> bool:
        """End the request `rid` if it is here; False if it is not."""
        req = self.by_rid.get(rid)
        if req is None:
            return False
        req.finish_reason = FinishReason.ABORT
        self._finish(req)
        return True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_running(self) -> int:
        return len(self.running)

    def reserved_pages(self) -> int:
        return decode_reserve_pages(self.running, self.cfg.decode_reserve_tokens, self.page_size)

    # ---- scheduling ---------------------------------------------------------------------
    def needs_sync(self) -> bool:
        """True when the next decode steps may not get pages without retracting a request, or the first waiting
        request would preempt a running one (`_preemptee`).

        Retraction must see every request's true state, so in overlap mode the loop waits for the
        batch in flight before scheduling when this is true.
        """
        need = sum(1 for r in self.running if self.pages.needs(r, 1))
        return need > self.allocator.num_free + self.radix.evictable_pages or self._preemptee(self.running) is not None

    def schedule(self) -> ScheduledBatch | None:
        plan = Plan()
        budget = self.cfg.max_batch_tokens
        while (victim := self._preemptee(self._retractable([]))) is not None:
            self._retract(victim)
        budget = self._plan_running(plan, budget)
        budget = self._plan_drafts(plan, budget)
        self._plan_admissions(plan, budget)
        if not plan.reqs:
            return None
        self.prompt_tokens_computed += sum(
            n for r, n in zip(plan.reqs, plan.extend, strict=True) if not r.num_generated
        )
        batch = build_batch(plan, self.page_size)
        self.in_flight.launched(batch)
        return batch

    def _plan_running(self, plan: Plan, budget: int) -> int:
        # Decode steps first, then the chunks of prompts already admitted; each in the policy's order.
        order = sorted(self.running, key=lambda r: (r.todo != 1, self.waiting.rank(r)))
        for r in order:
            if r not in self.running or r.finished or r.remaining_new_tokens() == 0:
                continue  # retracted by an earlier request of this loop, or nothing to compute
            if r.pending and not self.future_inputs:
                continue  # its token is still in the pipeline
            if budget <= 0 and plan.reqs:
                break
            n = self._take(r.todo, budget)
            if not self._ensure_pages(r, n, protected=plan.reqs):
                if self.running == [r]:
                    r.finish_reason = FinishReason.LENGTH  # alone and the KV cache is full
                    self._finish(r)
                continue
            plan.add(r, n)
            budget -= n
        return budget

    def _plan_drafts(self, plan: Plan, budget: int) -> int:
        """Speculative drafts for the planned decode steps, once every running request has its own token and
        page: a draft takes only the budget and the free pages left (it never evicts the cache, retracts a
        request or crowds out another's step)."""
        if self.drafter is None:
            return budget
        for i, r in enumerate(plan.reqs):
            limit = min(r.remaining_new_tokens() - 1, budget)
            if plan.extend[i] != 1 or r.todo != 1 or r.pending or limit <= 0:
                continue
            if not self.drafter.may_draft(r.rid, self.step_count):
                continue
            draft = self.drafter.propose(r.rid, r.fill_ids, limit)
            need = self.pages.needs(r, 1 + len(draft))
            if not draft or need > self.allocator.num_free:
                continue
            r.pages.extend(self.allocator.alloc(need) or [])
            plan.extend[i] += len(draft)
            plan.drafts[i] = draft
            budget -= len(draft)
        return budget

    def _plan_admissions(self, plan: Plan, budget: int) -> None:
        while self.waiting and self._has_slot():
            if budget <= 0 and plan.reqs:
                return
            req = self._next_admissible()
            if req is None or not self._admit(req):
                return
            self.waiting.remove(req)
            self.running.append(req)
            n = self._take(req.todo, budget)
            plan.add(req, n)
            budget -= n

    def _has_slot(self) -> bool:
        return len(self.running) + len(self.incoming) < self.cfg.max_running_requests

    def _next_admissible(self) -> Req | None:
        """The first waiting request that may be admitted now: one waiting for its pages from the KV store, or for a
        slot for its LoRA adapter, lets others pass."""
        return next((r for r in self.waiting if self.tiers.ready(r.rid) and self.adapters.fits(r)), None)

    def _preemptee(self, running: list[Req]) -> Req | None:
        """The request of `running` that the first waiting one preempts when it lacks a running slot or its pages
        (`WaitingQueue.preemptee`; fcfs: none): retracted before the step is planned, until it fits."""
        req = self._next_admissible()
        if req is None:
            return None
        victim = self.waiting.preemptee(req, running)
        if victim is None or (self._has_slot() and self.pages.fits(req, self.reserved_pages())):
            return None
        return victim

    def _take(self, todo: int, budget: int) -> int:
        """Tokens of a request to compute in this step: the whole rest, or a chunk of it."""
        chunk = self.cfg.chunk_size
        if chunk <= 0:
            return todo
        return max(1, min(todo, chunk, budget))

    def _admit(self, req: Req) -> bool:
        """Give `req` its prefix pages and private pages for the whole known sequence, or nothing."""
        claimed = self.claim_pages(req)
        if claimed is None:
            return False
        req.pages, req.num_computed = claimed, req.cached_tokens
        self.adapters.acquire(req)
        return True

    def claim_pages(self, req: Req) -> list[int] | None:
        """`RequestPages.claim`, keeping the running requests' reserve."""
        return self.pages.claim(req, self.reserved_pages())

    def _ensure_pages(self, req: Req, n: int, protected: list[Req]) -> bool:
        """Pages for `req`'s next `n` tokens, retracting others (never `protected` ones) if needed."""
        need = self.pages.needs(req, n)
        if need == 0:
            return True
        pages = self.pages.take(need)
        while pages is None and self._retract_one(req, protected):
            pages = self.pages.take(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def take_pages(self, n: int) -> list[int] | None:
        """`RequestPages.take`: what a load into the cache (the tiers) or a test takes."""
        return self.pages.take(n)

    def _retractable(self, keep: list[Req]) -> list[Req]:
        """Running requests that may give their pages back: not kept, not planned, none in flight (a step in
        flight would keep their pages past the retraction, `engine/in_flight.py`)."""
        return [
            r for r in self.running if not any(r is k for k in keep) and not r.pending and not self.in_flight.holds(r)
        ]

    def _retract_one(self, req: Req, protected: list[Req]) -> bool:
        """Retract the request the policy picks for `req`'s pages (`WaitingQueue.victim`); False if there is none."""
        victim = self.waiting.victim(self._retractable([req, *protected]), req)
        if victim is not None:
            self._retract(victim)
        return victim is not None

    def _retract(self, victim: Req) -> None:
        """Send a running request back to the waiting queue, keeping its tokens."""
        self.running.remove(victim)
        self.release(victim)
        victim.num_computed = 0
        self.waiting.requeue(victim)
        log.info("retracted %s (%d tokens) to free pages", victim.rid, victim.seq_len)

    # ---- results ------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, result: StepResult) -> StepOutcome:
        """Take a finished step's tokens; return what the step did."""
        self.step_count += 1
        outcome = StepOutcome()
        for i, r in enumerate(batch.reqs):
            try:
                self._process_one(batch, result, i, outcome)
            except Exception:
                log.exception("request %s: processing its step failed", r.rid)
                result.failed.add(i)
            # Still held here (not ended, not handed off): a failure may strike after its last token was taken.
            if i in result.failed and self.by_rid.get(r.rid) is r:
                self.fail(r, "producing its next token")
                outcome.failed.append(r)
        for r in self.in_flight.processed(batch):
            self.pages.give_back(r)
        return outcome

    def fail(self, req: Req, what: str) -> None:
        """End `req` alone after a failure of its own: a 500 naming its id, its pages released."""
        req.fail(500, internal_error(req.rid, what), INTERNAL_ERROR)
        self._finish(req)

    def _process_one(self, batch: ScheduledBatch, result: StepResult, i: int, outcome: StepOutcome) -> None:
        r = batch.reqs[i]
        r.trail.end("forward")
        if i in result.prompt:  # by position: a chunk computed again (after a retraction) replaces its scores
            start, scores = result.prompt[i]
            r.prompt_logprobs[start:] = scores
        if not batch.samples[i]:
            if not r.finished:
                outcome.chunks.append((r, batch.forward.seq_lens[i]))
            return
        r.pending -= 1
        extra = result.extra.get(i, [])
        draft = batch.draft(i)
        r.num_computed -= len(draft) - len(extra)  # the rejected drafts' slots are written again later
        if r.finished or i in result.failed:
            return  # aborted or finished while this step was in flight (its token is dropped), or failed
        s = Sampled(r, result.tokens[i], result.logprobs[i], result.top_logprobs[i])
        if draft:
            outcome.sampled += self._accept_run(s, [Sampled(r, *x) for x in extra], len(draft))
        else:
            (outcome.handed_off if self._accept(s) else outcome.sampled).append(s)

    def _accept_run(self, first: Sampled, kept: list[Sampled], drafted: int) -> list[Sampled]:
        """The tokens of a verified draft: appended up to the first that ends the request (EOS, a stop token,
        the length limit), streamed as one output, recorded for the drafter."""
        req, taken = first.req, []
        for s in [first, *kept]:
            req.append_token(s.token)
            taken.append(s)
            if req.finished:
                break
        if self.drafter is not None:
            self.drafter.record(req.rid, drafted, len(taken) - 1, self.step_count)
        logprobs = [s.logprob for s in taken] if first.logprob is not None else None
        tops = [s.top for s in taken] if first.top is not None else None
        self.outbox.emit_run(req, [s.token for s in taken], logprobs, tops)
        if req.finished:
            self._finish(req, emit=False)
        return taken

    def _accept(self, s: Sampled) -> bool:
        """Append a sampled token: stream it and end the request if it was its last.

        True when the request was handed off instead (its token and pages are the caller's)."""
        req = s.req
        req.append_token(s.token)
        if req.finished and req.handoff:
            self.running.remove(req)
            self.by_rid.pop(req.rid, None)
            return True
        self.outbox.emit(req, [s.token], s.logprob, s.top)
        if req.finished:
            self._finish(req, emit=False)
        return False

    # ---- endings ------------------------------------------------------------------------
    def _finish(self, req: Req, emit: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
            self.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.by_rid.pop(req.rid, None)
        self.tiers.forget(req.rid)
        if self.drafter is not None:
            self.drafter.forget(req.rid)
        if emit:
            self.outbox.emit(req, [])

    def release(self, req: Req) -> None:
        """Return a request's pages (`RequestPages.give_back`): whole computed pages to the radix cache, the rest freed.

        For a request out of the queues (retracted, finished, or handed off); one a step in flight computes for
        keeps them until that step is processed (`engine/in_flight.py`)."""
        if self.in_flight.holds(req):
            self.in_flight.defer(req)
        else:
            self.pages.give_back(req)
