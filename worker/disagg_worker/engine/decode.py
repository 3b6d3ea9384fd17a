"""Decode instance of a P/D deployment.

Life cycle of a request here:
1. Prealloc queue: a KVReceiver is created for its room and handshakes with the prefill instance
   (found through its bootstrap server). Once it is ready, pages for the whole prompt and an aux
   slot are preallocated, in arrival order, only while pages remain after reserving room for the
   running requests' next tokens.
2. Transfer queue: the prefill instance writes the prompt's KV straight into those pages; the
   receiver is polled without blocking. Success: the first token is read from the aux slot.
3. Running batch: the request joins the decode batch directly; its prompt is never recomputed.
Failure at any point ends the request with a 500 naming the cause. Pages a failed transfer may
still write (Mooncake does not cancel a submitted write) are quarantined until prefill confirms
it stopped or is known dead; every other page is freed at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from disagg_worker import messages as msg
from disagg_worker.config import EngineConfig
from disagg_worker.disagg import KVLayout, KVPoll, KVReceiver, RankInfo, create_kv_manager, unpack_first_token
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.request import Req
from disagg_worker.engine.scheduler import Scheduler, pages_for
from disagg_worker.mem.radix import RadixCache
from disagg_worker.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(eq=False)
class DecodeReq:
    req: Req
    receiver: KVReceiver
    pages: list[int] = field(default_factory=list)
    aux_slot: int = -1


class DecodeEngine(Engine):
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module | None, model_cfg: ModelConfig):
        super().__init__(cfg, model, model_cfg)
        # Decode never matches prompts: they arrive as KV. Finished pages go straight back.
        self.radix = RadixCache(cfg.cache.page_size, self.allocator, enabled=False)
        self.scheduler = Scheduler(cfg, self.allocator, self.radix)
        slots = 2 * cfg.scheduler.max_running_requests
        layout = KVLayout.from_pool(self.kv_pool, cfg.cache.kv_dtype, aux_num_slots=slots)
        self.kv = create_kv_manager(cfg.disagg, layout, RankInfo())
        self.free_slots = list(range(slots))
        self.prealloc: dict[str, DecodeReq] = {}
        self.transfer: dict[str, DecodeReq] = {}
        self.quarantine: list[DecodeReq] = []

    def arrive(self, m: msg.GenerateReq) -> None:
        req = self.make_req(m)
        problem = self.routing_problem(req, m)
        if problem:
            return self.reject(req, 400, problem)
        addr = f"{m.bootstrap.host}:{m.bootstrap.port}"
        self.prealloc[req.rid] = DecodeReq(req, self.kv.create_receiver(m.bootstrap.room, addr))

    def abort(self, rid: str) -> None:
        d = self.prealloc.pop(rid, None)
        if d is not None:
            d.receiver.abort("the decode request was aborted")
            return
        d = self.transfer.get(rid)
        if d is not None:
            d.receiver.abort("the decode request was aborted")  # its poll frees or quarantines the pages
            return
        self.scheduler.abort(rid)

    @property
    def waiting_on_transfers(self) -> bool:
        return bool(self.prealloc or self.transfer or self.quarantine)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.kv.on_change = wake

    def tick(self) -> None:
        self._poll_prealloc()
        self._poll_transfer()
        self._poll_quarantine()

    def _poll_prealloc(self) -> None:
        for rid, d in list(self.prealloc.items()):
            state = d.receiver.poll()
            if state is KVPoll.Failed:
                del self.prealloc[rid]
                self.reject(d.req, 500, f"KV transfer handshake failed: {d.receiver.failure_reason()}")
                continue
            if state is KVPoll.Bootstrapping:
                continue
            if not self._preallocate(d):
                return  # first come, first served: later requests wait behind this one
            del self.prealloc[rid]
            self.transfer[rid] = d

    def _preallocate(self, d: DecodeReq) -> bool:
        s = self.scheduler
        if not self.free_slots or len(s.running) + len(self.transfer) >= self.cfg.scheduler.max_running_requests:
            return False
        need = pages_for(d.req.seq_len, self.cfg.cache.page_size)
        reserve = sum(
            pages_for(min(r.remaining_new_tokens(), self.cfg.scheduler.decode_reserve_tokens), self.cfg.cache.page_size)
            for r in s.running
        )
        if need + reserve > self.allocator.num_free:
            return False
        d.pages = self.allocator.alloc(need)
        d.aux_slot = self.free_slots.pop()
        d.receiver.init(d.pages, d.aux_slot)
        return True

    def _poll_transfer(self) -> None:
        for rid, d in list(self.transfer.items()):
            state = d.receiver.poll()
            if state is KVPoll.Success:
                del self.transfer[rid]
                self._start_decoding(d)
            elif state is KVPoll.Failed:
                del self.transfer[rid]
                failure = d.receiver.failure()
                if failure is not None and failure.pages_unsafe:
                    self.quarantine.append(d)
                else:
                    self._free(d)
                self.reject(d.req, 500, f"KV transfer failed: {d.receiver.failure_reason()}")

    def _start_decoding(self, d: DecodeReq) -> None:
        token, logprob = unpack_first_token(d.receiver.aux_bytes())
        self.free_slots.append(d.aux_slot)
        req = d.req
        req.pages, req.num_computed = d.pages, len(req.prompt_ids)
        req.output_ids.append(token)
        req.sampling.output_ids.append(token)
        req.check_finished(token)
        self.scheduler.emit(req, [token], logprob)
        if req.finished:
            self.scheduler.release(req)
        else:
            self.scheduler.add_running(req)

    def _poll_quarantine(self) -> None:
        for d in list(self.quarantine):
            failure = d.receiver.failure()
            if failure is None or not failure.pages_unsafe:
                self.quarantine.remove(d)
                self._free(d)

    def _free(self, d: DecodeReq) -> None:
        self.allocator.free(d.pages)
        d.pages = []
        self.free_slots.append(d.aux_slot)

    def queue_sizes(self) -> dict[str, int]:
        return {
            "decode_prealloc": len(self.prealloc),
            "decode_transfer": len(self.transfer),
            "decode_quarantine": len(self.quarantine),
        }

    def close(self) -> None:
        self.kv.close()
