"""Prefill stage of a P/D deployment.

Life cycle of a request here:
1. Bootstrap queue: a KVSender is created for its room; the request waits until the decode side
   has handshaken and sent its destination pages (WaitingForInput). A bounded queue: when full,
   new requests are refused at once (503) instead of piling up.
2. Waiting queue: the normal scheduler (prefix cache, chunked prefill) with max_new_tokens = 1.
   After each chunk, the pages it completed are sent; a partial last page waits for the next chunk.
3. Inflight queue: the scheduler hands the request back with its pages once the first token is
   sampled; the remaining pages and the first token (aux) are sent with the last chunk, and the
   sender is polled without blocking. With a layer pipeline (prompts of at least its minimum length), the
   pages a chunk completes are armed before its forward (`before_forward`, `KVSender.stream`) and leave
   layer group by layer group while it runs; the sends after the step then carry only what no stream sent.
   Success: pages go to the prefix cache and the request answers with its token. Failure: pages freed,
   500 with the cause. The aux record names the LoRA adapter the prompt ran under (`disagg.adapter_tag`).
A traced request's trail (`request/trail.py`) marks `prefill.bootstrap` (1), the scheduler marks its waiting
and each chunk's `forward` (2), and `kv.transfer` runs from its first pages sent to the sender's end (3).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg import KVPoll, KVSender, pack_aux
from disagg_worker.engine.batch import Sampled, ScheduledBatch, StepOutcome
from disagg_worker.engine.outbox import Outbox, transfer_error
from disagg_worker.engine.request import Req
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.stage import UNROUTED, Transfers
from disagg_worker.mem.allocator import pages_for
from disagg_worker.request.messages import BootstrapInfo
from disagg_worker.request.trail import Trail

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillReq:
    req: Req
    sender: KVSender
    sent_pages: int = 0
    streamed_pages: int = 0  # pages armed for a layer-wise stream (`before_forward`)
    first: Sampled | None = None


class PrefillStage:
    def __init__(
        self,
        cfg: DisaggConfig,
        page_size: int,
        scheduler: Scheduler,
        outbox: Outbox,
        kv: Transfers,
        whole_prompt: bool = False,
        page_nbytes: int = 0,
        stream_from: int = 0,
        kv_written: Callable[[], None] = lambda: None,
    ):
        """`whole_prompt`: send every page with the first token, none after each chunk (a draft model writes
        its KV into the prompt's pages once the first token is known, `drafting.ModelDrafter.handoff`);
        `page_nbytes`: the KV bytes of one page on this rank, which a traced transfer reports; `stream_from`:
        prompts of at least this many tokens stream their KV layer group by layer group (0: none); `kv_written`:
        waits until the last forward's KV is in the pool (the runner's, on a CUDA device), before pages are sent."""
        self.cfg = cfg
        self.kv_written = kv_written
        self.stream_from = stream_from
        self.page_nbytes = page_nbytes
        self.whole_prompt = whole_prompt
        self.page_size = page_size
        self.scheduler = scheduler
        self.outbox = outbox
        self.kv = kv
        self.bootstrapping: dict[str, PrefillReq] = {}
        self.prefilling: dict[str, PrefillReq] = {}
        self.inflight: dict[str, PrefillReq] = {}

    # ---- arrivals and aborts -------------------------------------------------------------
    def arrive(self, req: Req, bootstrap: BootstrapInfo | None) -> None:
        if bootstrap is None:
            self.outbox.reject(req, 400, UNROUTED.format(role="prefill"))
        elif len(self.bootstrapping) >= self.cfg.max_bootstrap_queue:
            self.outbox.reject(req, 503, "the prefill bootstrap queue is full; retry later")
        else:  # prefill computes the prompt and its first token, then hands the request off
            req.hand_off_after_first_token()
            self.bootstrapping[req.rid] = PrefillReq(req, self.kv.create_sender(bootstrap.room))
            req.trail.begin("prefill.bootstrap", room=bootstrap.room)

    def abort(self, rid: str) -> bool:
        held = False
        for queue in (self.bootstrapping, self.prefilling, self.inflight):
            p = queue.get(rid)
            if p is not None:
                p.sender.abort("the prefill request was aborted")
                held = True
        self.bootstrapping.pop(rid, None)
        if self.prefilling.pop(rid, None) is not None:
            self.scheduler.abort(rid)
        return held  # an inflight request ends when its poll sees the abort

    # ---- queues --------------------------------------------------------------------------
    @property
    def waiting_on_transfers(self) -> bool:
        return bool(self.bootstrapping or self.inflight)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.kv.on_change = wake

    def tick(self) -> None:
        self._poll_bootstrapping()
        self._poll_inflight()

    def before_forward(self, batch: ScheduledBatch) -> None:
        """Arm the streams of the pages this forward completes: every full page of a chunk, and with the
        prompt's last chunk its partial last page too (its KV is final once the forward ran)."""
        if not self.stream_from:
            return
        for req, done in zip(batch.reqs, batch.forward.seq_lens, strict=True):
            p = self.prefilling.get(req.rid)
            if p is None or len(req.prompt_ids) < self.stream_from:
                continue
            prompt = len(req.prompt_ids)
            upto = pages_for(prompt, self.page_size) if done >= prompt else done // self.page_size
            start = max(p.streamed_pages, p.sent_pages)
            if upto > start:
                req.trail.begin_once("kv.transfer")
                p.sender.stream(req.pages[start:upto])
                p.streamed_pages = upto

    def on_step(self, outcome: StepOutcome) -> None:
        if outcome.chunks or outcome.handed_off:  # pages about to go to the transfer: their KV written first
            self.kv_written()
        for req, done in [] if self.whole_prompt else outcome.chunks:
            p = self.prefilling.get(req.rid)
            full = done // self.page_size
            if p is not None and full > p.sent_pages:
                req.trail.begin_once("kv.transfer")
                p.sender.send(req.pages[p.sent_pages : full], last=False)
                p.sent_pages = full
        for s in outcome.handed_off:
            self._start_transfer(s)
        for req in outcome.failed:  # ended by the scheduler (500, pages released): decode stops waiting
            p = self.prefilling.pop(req.rid, None)
            if p is not None:
                p.sender.abort("the request failed on the prefill instance")

    def _poll_bootstrapping(self) -> None:
        for rid, p in list(self.bootstrapping.items()):
            state = p.sender.poll()
            if state is KVPoll.Failed:
                del self.bootstrapping[rid]
                why = transfer_error(p.req.rid, "KV transfer bootstrap failed", p.sender.failure_reason())
                self.outbox.reject(p.req, 500, why)
            elif state >= KVPoll.WaitingForInput:
                del self.bootstrapping[rid]
                p.req.trail.end("prefill.bootstrap")
                self.prefilling[rid] = p
                self.scheduler.add(p.req)

    def _start_transfer(self, s: Sampled) -> None:
        """The first token is sampled: send the rest of the prompt's pages with it."""
        p = self.prefilling.pop(s.req.rid, None)
        if p is None:  # not ours (cannot happen: an aborted request is never handed off)
            self.scheduler.release(s.req)
            return
        p.first = s
        total = pages_for(len(s.req.prompt_ids), self.page_size)
        # With a draft model: decode's first draft; with a LoRA adapter: its tag, which decode checks.
        aux = pack_aux(s.token, s.logprob, s.top, s.req.draft_aux, s.req.params.lora)
        s.req.trail.begin_once("kv.transfer")
        p.sender.send(s.req.pages[p.sent_pages : total], last=True, aux=aux)
        p.sent_pages = total
        self.inflight[s.req.rid] = p

    def _poll_inflight(self) -> None:
        for rid, p in list(self.inflight.items()):
            state = p.sender.poll()
            if not state.terminal:
                continue
            del self.inflight[rid]
            self._trace_transfer(p.req.trail, p, state)
            self.scheduler.release(p.req)
            if state is KVPoll.Success and p.first is not None:
                self.outbox.emit(p.req, [p.first.token], p.first.logprob)
            else:
                why = transfer_error(p.req.rid, "KV transfer failed", p.sender.failure_reason())
                self.outbox.reject(p.req, 500, why)

    def _trace_transfer(self, trail: Trail, p: PrefillReq, state: KVPoll) -> None:
        pages, peers = p.sent_pages, ",".join(p.sender.peers())
        trail.end("kv.transfer", pages=pages, bytes=pages * self.page_nbytes, peer=peers, status=state.name)

    def queue_sizes(self) -> dict[str, int]:
        return {
            "prefill_bootstrap": len(self.bootstrapping),
            "prefill_inflight": len(self.inflight),
            "prefill_forward": len(self.prefilling),
        }

    def close(self) -> None:
        self.kv.close()
