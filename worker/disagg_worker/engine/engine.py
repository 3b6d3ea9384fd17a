"""The engine of one instance: model runner, KV pool, prefix cache, scheduler, and its role stage.

Every role runs the same engine; a prefill or decode instance adds a role stage (`engine.stage`)
that owns the KV transfer queues. The loop (`engine.loop`) drives it through `handle` (requests
and aborts) and the step methods (`tick`, `schedule`, `run`, `process`); the engine routes each
to the part that owns it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from prometheus_client import REGISTRY, generate_latest

from disagg_worker import messages as msg
from disagg_worker.config import EngineConfig
from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.outbox import Outbox
from disagg_worker.engine.request import Req
from disagg_worker.engine.runner import ModelRunner
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.stage import build_stage
from disagg_worker.limits import RequestLimits
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.radix import RadixCache
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.loader import load_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module | None, model_cfg: ModelConfig):
        self.cfg = cfg
        self.model_cfg = model_cfg
        cache = cfg.cache
        self.max_context_len = cfg.max_context_len or model_cfg.max_position_embeddings
        self.kv_pool = KVPool(
            num_layers=model_cfg.num_layers,
            num_pages=cache.total_pages,
            page_size=cache.page_size,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            dtype=DTYPES[cache.kv_dtype],
            device=cfg.device,
        )
        self.allocator = PageAllocator(cache.total_pages)
        self.radix = RadixCache(cache.page_size, self.allocator, enabled=cfg.uses_prefix_cache)
        self.outbox = Outbox()
        self.scheduler = Scheduler(cfg.scheduler, cache.page_size, self.allocator, self.radix, self.outbox)
        self.runner = ModelRunner(model, self.kv_pool, model_cfg.vocab_size, cfg.device)
        self.stage = build_stage(cfg, self.kv_pool, self.scheduler, self.allocator, self.outbox)
        self.limits = RequestLimits(self.max_context_len, model_cfg.vocab_size, cache.capacity_tokens)
        self.eos_ids = frozenset(model_cfg.eos_token_ids)

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> Engine:
        torch.manual_seed(cfg.seed)
        model, model_cfg = load_model(cfg.model_path, DTYPES[cfg.dtype], cfg.device)
        return cls(cfg, None if cfg.forward == "noop" else model, model_cfg)

    # ---- messages from the HTTP process -------------------------------------------------------
    def handle(self, m: msg.Message) -> None:
        if isinstance(m, msg.GenerateReq):
            self.arrive(m)
        elif isinstance(m, msg.AbortReq):
            self.abort(m.rid)
        elif isinstance(m, msg.FlushCacheReq):
            self.radix.evict(self.radix.total_pages)
        else:
            log.warning("ignoring unexpected message %s", type(m).__name__)

    def arrive(self, m: msg.GenerateReq) -> None:
        req = Req(
            rid=m.rid,
            prompt_ids=list(m.input_ids),
            params=m.params,
            eos_ids=self.eos_ids,
            max_context_len=self.max_context_len,
        )
        problem = self.limits.kv_problem(len(req.prompt_ids))  # it would wait for pages forever
        if problem:
            self.outbox.reject(req, 400, problem)
        elif self.stage is not None:
            self.stage.arrive(req, m.bootstrap)
        else:
            self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        if self.stage is None or not self.stage.abort(rid):
            self.scheduler.abort(rid)

    # ---- stepping (engine.loop) ---------------------------------------------------------------
    def tick(self) -> None:
        """Advance whatever does not need the model (P/D queues); called before each schedule."""
        if self.stage is not None:
            self.stage.tick()

    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def needs_sync(self) -> bool:
        return self.scheduler.needs_sync()

    def run(self, batch: ScheduledBatch) -> StepResult:
        """The forward and sampling of one batch (on the runner thread with overlap)."""
        return self.runner.run(batch)

    def process(self, batch: ScheduledBatch, result: StepResult) -> None:
        outcome = self.scheduler.process(batch, result)
        if self.stage is not None:
            self.stage.on_step(outcome)

    def take_outputs(self) -> list[msg.TokenOut]:
        return self.outbox.take()

    @property
    def has_batch_work(self) -> bool:
        """A forward could be scheduled now."""
        return not self.scheduler.idle

    @property
    def waiting_on_transfers(self) -> bool:
        """Requests wait on KV transfers (P/D roles); the loop polls them often."""
        return self.stage is not None and self.stage.waiting_on_transfers

    @property
    def idle(self) -> bool:
        """Nothing to do until a message arrives."""
        return self.scheduler.idle and not self.waiting_on_transfers

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake` is called, from any thread, when a KV transfer this engine waits on moves."""
        if self.stage is not None:
            self.stage.set_wakeup(wake)

    # ---- reports -------------------------------------------------------------------------------
    def info(self) -> msg.EngineInfo:
        return msg.EngineInfo(
            model_name=self.cfg.model_name,
            vocab_size=self.model_cfg.vocab_size,
            max_context_len=self.max_context_len,
            capacity_tokens=self.cfg.cache.capacity_tokens,
            page_size=self.cfg.cache.page_size,
            total_pages=self.cfg.cache.total_pages,
            eos_token_ids=sorted(self.eos_ids),
        )

    def stats(self) -> msg.SchedulerStats:
        s = self.scheduler
        return msg.SchedulerStats(
            time=time.time(),
            running=len(s.running),
            waiting=len(s.waiting),
            pages_used=self.allocator.num_used,
            pages_total=self.allocator.num_total,
            cache_hit_tokens=self.radix.stats.hit_tokens,
            cache_query_tokens=self.radix.stats.queried_tokens,
            step_count=s.step_count,
            cache_pages=self.radix.total_pages,
            cache_refs=self.radix.total_refs(),
            pid=os.getpid(),
            queues=self.queue_sizes(),
            metrics_text=own_metrics(),
        )

    def queue_sizes(self) -> dict[str, int]:
        """Sizes of the P/D queues (none for a monolithic instance)."""
        return self.stage.queue_sizes() if self.stage is not None else {}

    def close(self) -> None:
        """Release what the engine holds outside this process (transfer engines)."""
        if self.stage is not None:
            self.stage.close()

    def pages_accounted(self) -> bool:
        """At idle, every page is free or held unlocked by the prefix cache."""
        return (
            self.allocator.num_free + self.radix.total_pages == self.allocator.num_total
            and self.radix.total_refs() == 0
        )


def own_metrics() -> str:
    """This process's `disagg_*` Prometheus series (the HTTP process serves them on /metrics)."""
    text = generate_latest(REGISTRY).decode()
    keep = [
        line
        for line in text.splitlines()
        if line.startswith("disagg_") or line.startswith(("# HELP disagg_", "# TYPE disagg_"))
    ]
    return "\n".join(keep) + ("\n" if keep else "")
