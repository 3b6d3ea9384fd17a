"""Decode stage of a P/D deployment.

Life cycle of a request here:
1. Prealloc queue: a KVReceiver is created for its room and handshakes with the prefill instance
   (found through its bootstrap server). Once it is ready, pages for the whole prompt and an aux
   slot are preallocated, in the scheduling policy's order (`engine/waiting.py`: arrival, or priority),
   only while pages remain after reserving room for the running requests' next tokens. With decode's
   prefix cache (`--decode-prefix-cache`) the prompt's leading pages this instance already holds are
   taken from the cache instead, and prefill sends only
   the pages after them (always the one holding the prompt's last token). A bounded queue, like
   prefill's bootstrap queue: when full, new requests are refused at once (503).
   A request under a LoRA adapter is preallocated once its adapter holds a slot (`lora_registry.Resident`; the
   others pass it meanwhile), and holds the slot until its pages are released.
2. Transfer queue: the prefill instance writes the prompt's KV straight into those pages; the
   receiver is polled without blocking. Success: the first token is read from the aux slot, and the adapter
   the aux record names must be the request's (else the request fails: KV of another adapter never decodes).
3. Running batch: the request joins the decode batch directly; its prompt is never recomputed.
A request the router marks `local_prefill` skips all this (`--local-prefill`): the scheduler computes
its prompt here like a monolithic instance's, from the prefix cache when it holds the start, in a running
slot that no request in transfer holds (those join the running batch without asking).
With the model's shared secret, a request's bootstrap target (the prefill instance to contact)
is taken only with the router's signature over it: any other is refused (403) before anything is
contacted. Failure at any point ends the request with a 500 naming the cause. Pages a failed
transfer may still write (Mooncake does not cancel a submitted write) are quarantined until
prefill confirms it stopped or is known dead (or, at the latest, after the quarantine timeout);
every other page is freed at once.
A traced request's trail (`request/trail.py`) marks `decode.prealloc` (1) and `kv.transfer` (2); the scheduler
marks `decoding` from its first token (3) to its finish.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg import (
    KVPoll,
    KVReceiver,
    adapter_tag,
    unpack_adapter_tag,
    unpack_draft,
    unpack_first_token,
    unpack_top_logprobs,
)
from disagg_worker.engine.batch import ScheduledBatch, StepOutcome
from disagg_worker.engine.drafting import received_draft
from disagg_worker.engine.outbox import Outbox, transfer_error
from disagg_worker.engine.request import Req
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.stage import UNROUTED, Transfers
from disagg_worker.keys import target_signed
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.request.messages import BootstrapInfo

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeReq:
    req: Req
    receiver: KVReceiver
    pages: list[int] = field(default_factory=list)
    aux_slot: int = -1
    peer: str = ""  # the prefill's bootstrap address


class DecodeStage:
    def __init__(
        self,
        cfg: DisaggConfig,
        page_size: int,
        scheduler: Scheduler,
        allocator: PageAllocator,
        outbox: Outbox,
        kv: Transfers,
        aux_slots: int,
        draft_model: bool = False,
        page_nbytes: int = 0,
        transfer: dict[str, DecodeReq] | None = None,
    ):
        """`page_nbytes`: the KV bytes of one page on this rank, which a traced transfer reports. `transfer`:
        where the requests whose KV is on its way are kept, shared with the scheduler, which counts them as
        running (`Scheduler.incoming`): it admits local prefills around them."""
        self.page_size = page_size
        self.page_nbytes = page_nbytes
        self.target_key = cfg.target_key
        self.max_prealloc = cfg.max_prealloc_queue
        self.draft_model = draft_model
        self.max_running = scheduler.cfg.max_running_requests
        self.scheduler = scheduler
        self.allocator = allocator
        self.outbox = outbox
        self.kv = kv
        self.free_slots = list(range(aux_slots))
        self.prealloc: dict[str, DecodeReq] = {}
        self.transfer = transfer if transfer is not None else {}
        self.quarantine: list[DecodeReq] = []

    def arrive(self, req: Req, bootstrap: BootstrapInfo | None) -> None:
        if bootstrap is None:
            self.outbox.reject(req, 400, UNROUTED.format(role="decode"))
            return
        if self.target_key and not target_signed(
            self.target_key, bootstrap.signed_host, bootstrap.port, bootstrap.room, bootstrap.sig
        ):
            self.outbox.reject(req, 403, "bootstrap target not signed by this model's router: refused")
            return
        if len(self.prealloc) >= self.max_prealloc:
            self.outbox.reject(req, 503, "the decode prealloc queue is full; retry later")
            return
        receiver = self.kv.create_receiver(bootstrap.room, bootstrap.address)
        self.prealloc[req.rid] = DecodeReq(req, receiver, peer=bootstrap.address)
        req.trail.begin("decode.prealloc", room=bootstrap.room)

    def abort(self, rid: str) -> bool:
        d = self.prealloc.pop(rid, None) or self.transfer.get(rid)
        if d is None:
            return False
        d.receiver.abort("the decode request was aborted")  # in transfer: its poll frees or quarantines the pages
        return True

    @property
    def waiting_on_transfers(self) -> bool:
        return bool(self.prealloc or self.transfer or self.quarantine)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.kv.on_change = wake

    def tick(self) -> None:
        self._poll_prealloc()
        self._poll_transfer()
        self._poll_quarantine()

    def before_forward(self, batch: ScheduledBatch) -> None:
        return None  # decode computes no prompt whose KV it sends

    def on_step(self, outcome: StepOutcome) -> None:
        """Decode sends nothing after a forward."""

    def _poll_prealloc(self) -> None:
        for d in sorted(self.prealloc.values(), key=lambda d: self.scheduler.waiting.rank(d.req)):
            rid, state = d.req.rid, d.receiver.poll()
            if state is KVPoll.Failed:
                del self.prealloc[rid]
                why = transfer_error(d.req.rid, "KV transfer handshake failed", d.receiver.failure_reason())
                self.outbox.reject(d.req, 500, why)
                continue
            if state is KVPoll.Bootstrapping or not self.scheduler.adapters.fits(d.req):
                continue  # a request whose adapter waits for a slot lets the others pass, as in the scheduler
            if not self._preallocate(d):
                return  # in the policy's order: the requests after this one wait behind it
            del self.prealloc[rid]
            self.transfer[rid] = d

    def _preallocate(self, d: DecodeReq) -> bool:
        if not self.free_slots or self.scheduler.num_running + len(self.transfer) >= self.max_running:
            return False
        pages = self.scheduler.claim_pages(d.req)  # held pages first (decode's prefix cache), sent by nobody
        if pages is None:
            return False
        d.pages = pages
        self.scheduler.adapters.acquire(d.req)  # released with its pages (`RequestPages.release`), or on failure
        d.aux_slot = self.free_slots.pop()
        d.receiver.init(pages[d.req.prefix_pages :], d.aux_slot, skip_pages=d.req.prefix_pages)
        sent = len(pages) - d.req.prefix_pages
        d.req.trail.end("decode.prealloc", pages=len(pages), cached_pages=d.req.prefix_pages)
        d.req.trail.begin("kv.transfer", pages=sent, bytes=sent * self.page_nbytes, peer=d.peer)
        return True

    def _poll_transfer(self) -> None:
        for rid, d in list(self.transfer.items()):
            state = d.receiver.poll()
            if state.terminal:
                d.req.trail.end("kv.transfer", status=state.name)
            if state is KVPoll.Success:
                del self.transfer[rid]
                aux = d.receiver.aux_bytes()
                if unpack_adapter_tag(aux) != adapter_tag(d.req.params.lora):
                    self._refuse_adapter(d)
                    continue
                token, logprob = unpack_first_token(aux)
                self.free_slots.append(d.aux_slot)
                if self.draft_model:
                    d.req.draft = received_draft(len(d.req.prompt_ids), unpack_draft(aux))
                self.scheduler.add_running(d.req, d.pages, token, logprob, unpack_top_logprobs(aux))
            elif state is KVPoll.Failed:
                del self.transfer[rid]
                self.scheduler.adapters.release(d.req)  # no forward reads its slot
                self._give_back_prefix(d)  # no transfer writes the held pages: only the others may be unsafe
                failure = d.receiver.failure()
                if failure is not None and failure.pages_unsafe:
                    self.quarantine.append(d)
                else:
                    self._free(d)
                why = transfer_error(d.req.rid, "KV transfer failed", d.receiver.failure_reason())
                self.outbox.reject(d.req, 500, why)

    def _refuse_adapter(self, d: DecodeReq) -> None:
        """The KV that arrived was computed under another LoRA adapter than the request's: the request fails (the
        transfer is over, so its pages are free again), never decoding on the wrong KV."""
        self.scheduler.adapters.release(d.req)
        self._free(d)
        mine = f"LoRA adapter {d.req.params.lora}" if d.req.params.lora else "the base model"
        why = f"request {d.req.rid}: prefill computed the prompt under another adapter than {mine}: refused"
        log.warning("%s", why)
        self.outbox.reject(d.req, 500, why)

    def _poll_quarantine(self) -> None:
        for d in list(self.quarantine):
            failure = d.receiver.failure()
            if failure is None or not failure.pages_unsafe:
                self.quarantine.remove(d)
                self._free(d)

    def _free(self, d: DecodeReq) -> None:
        self._give_back_prefix(d)
        self.allocator.free(d.pages)
        d.pages = []
        self.free_slots.append(d.aux_slot)

    def _give_back_prefix(self, d: DecodeReq) -> None:
        """Unlock the cached pages a failed request held (its first `prefix_pages`); `d.pages` keeps the others."""
        req = d.req
        if req.prefix_node is not None:
            self.scheduler.radix.unlock(req.prefix_node)
        d.pages, req.prefix_node, req.prefix_pages = d.pages[req.prefix_pages :], None, 0

    def queue_sizes(self) -> dict[str, int]:
        return {
            "decode_prealloc": len(self.prealloc),
            "decode_transfer": len(self.transfer),
            "decode_quarantine": len(self.quarantine),
        }

    def close(self) -> None:
        self.kv.close()
