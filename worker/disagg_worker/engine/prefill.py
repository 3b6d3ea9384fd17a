"""Prefill instance of a P/D deployment.

Life cycle of a request here:
1. Bootstrap queue: a KVSender is created for its room; the request waits until the decode side
   has handshaken and sent its destination pages (WaitingForInput). A bounded queue: when full,
   new requests are refused at once (503) instead of piling up.
2. Waiting queue: the normal scheduler (prefix cache, chunked prefill) with max_new_tokens = 1.
   After each chunk, the pages it completed are sent; a partial last page waits for the next chunk.
3. Inflight queue: the first token is sampled; the remaining pages and the first token (aux) are
   sent with the last chunk; the sender is polled without blocking. Success: pages go to the
   prefix cache and the request answers with its token. Failure: pages freed, 500 with the cause.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from disagg_worker import messages as msg
from disagg_worker.config import EngineConfig
from disagg_worker.disagg import KVLayout, KVPoll, KVSender, RankInfo, create_kv_manager, pack_first_token
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.request import Req
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillReq:
    req: Req
    sender: KVSender
    sent_pages: int = 0
    first_token: int = -1
    logprob: float | None = None


class PrefillScheduler(Scheduler):
    """Holds finished requests (with their pages) for the transfer instead of releasing them."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sampled: list[tuple[Req, int, float | None]] = []
        # (request, tokens whose KV this step completed): num_computed may already count a later
        # step still in flight (overlap), whose pages must not be sent yet.
        self.chunked: list[tuple[Req, int]] = []

    def process(self, batch, result) -> None:
        super().process(batch, result)
        for r, sampled, done in zip(batch.reqs, batch.samples, batch.forward.seq_lens):
            if not sampled and not r.finished:
                self.chunked.append((r, done))

    def _on_token(self, req: Req, token: int, logprob, top) -> None:
        self.detach(req)
        self.sampled.append((req, token, logprob))


class PrefillEngine(Engine):
    scheduler: PrefillScheduler

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module | None, model_cfg: ModelConfig):
        super().__init__(cfg, model, model_cfg)
        self.scheduler = PrefillScheduler(cfg, self.allocator, self.radix)
        layout = KVLayout.from_pool(self.kv_pool, cfg.cache.kv_dtype)
        bootstrap = f"http://127.0.0.1:{cfg.disagg.bootstrap_port}"
        self.kv = create_kv_manager(cfg.disagg, layout, RankInfo(bootstrap_url=bootstrap))
        self.bootstrapping: dict[str, PrefillReq] = {}
        self.prefilling: dict[str, PrefillReq] = {}
        self.inflight: dict[str, PrefillReq] = {}

    # ---- arrivals and aborts -------------------------------------------------------------
    def arrive(self, m: msg.GenerateReq) -> None:
        req = self.make_req(replace(m, params=replace(m.params, max_new_tokens=1, min_new_tokens=0)))
        problem = self.routing_problem(req, m)
        if problem:
            return self.reject(req, 400, problem)
        if len(self.bootstrapping) >= self.cfg.disagg.max_bootstrap_queue:
            return self.reject(req, 503, "the prefill bootstrap queue is full; retry later")
        self.bootstrapping[req.rid] = PrefillReq(req, self.kv.create_sender(m.bootstrap.room))

    def abort(self, rid: str) -> None:
        for queue in (self.bootstrapping, self.prefilling, self.inflight):
            p = queue.get(rid)
            if p is not None:
                p.sender.abort("the prefill request was aborted")
        self.scheduler.abort(rid)
        self.prefilling.pop(rid, None)
        self.bootstrapping.pop(rid, None)

    # ---- queues --------------------------------------------------------------------------
    @property
    def waiting_on_transfers(self) -> bool:
        return bool(self.bootstrapping or self.inflight or self.tick_ready)

    @property
    def tick_ready(self) -> bool:  # a finished chunk or first token to hand to the sender
        return bool(self.scheduler.sampled or self.scheduler.chunked)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.kv.on_change = wake

    def tick(self) -> None:
        self._poll_bootstrapping()
        self._send_chunks()
        self._start_transfers()
        self._poll_inflight()

    def _poll_bootstrapping(self) -> None:
        for rid, p in list(self.bootstrapping.items()):
            state = p.sender.poll()
            if state is KVPoll.Failed:
                del self.bootstrapping[rid]
                self.reject(p.req, 500, f"KV transfer bootstrap failed: {p.sender.failure_reason()}")
            elif state >= KVPoll.WaitingForInput:
                del self.bootstrapping[rid]
                self.prefilling[rid] = p
                self.scheduler.add(p.req)

    def _send_chunks(self) -> None:
        chunked, self.scheduler.chunked = self.scheduler.chunked, []
        for req, done in chunked:
            p = self.prefilling.get(req.rid)
            if p is None:
                continue
            full = done // self.cfg.cache.page_size
            if full > p.sent_pages:
                p.sender.send(req.pages[p.sent_pages : full], last=False)
                p.sent_pages = full

    def _start_transfers(self) -> None:
        sampled, self.scheduler.sampled = self.scheduler.sampled, []
        for req, token, logprob in sampled:
            p = self.prefilling.pop(req.rid, None)
            if p is None:  # aborted meanwhile: its pages are still ours
                self.scheduler.release(req)
                continue
            p.first_token, p.logprob = token, logprob
            total = (len(req.prompt_ids) + self.cfg.cache.page_size - 1) // self.cfg.cache.page_size
            p.sender.send(req.pages[p.sent_pages : total], last=True, aux=pack_first_token(token, logprob))
            p.sent_pages = total
            self.inflight[req.rid] = p

    def _poll_inflight(self) -> None:
        for rid, p in list(self.inflight.items()):
            state = p.sender.poll()
            if state not in (KVPoll.Success, KVPoll.Failed):
                continue
            del self.inflight[rid]
            self.scheduler.release(p.req)
            if state is KVPoll.Success:
                p.req.check_finished(p.first_token)
                self.scheduler.emit(p.req, [p.first_token], p.logprob)
            else:
                self.reject(p.req, 500, f"KV transfer failed: {p.sender.failure_reason()}")

    def queue_sizes(self) -> dict[str, int]:
        return {
            "prefill_bootstrap": len(self.bootstrapping),
            "prefill_inflight": len(self.inflight),
            "prefill_forward": len(self.prefilling),
        }

    def close(self) -> None:
        self.kv.close()
