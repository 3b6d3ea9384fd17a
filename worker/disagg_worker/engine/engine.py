"""The engine of one instance: model runner, KV pool, prefix cache, scheduler, and its role stage.

Every role runs the same engine; a prefill or decode instance adds a role stage (`engine.stage`)
that owns the KV transfer queues. The loop (`instance.loop`) drives it through `handle` (requests
and aborts) and the step methods (`tick`, `schedule`, `run`/`launch`, `process`); the engine
routes each to the part that owns it.

In a multi-rank instance this engine is the driver (tensor rank 0 of pipeline stage 0): it holds
its slice of the model and KV, schedules for every rank, and runs each step on all of them through
`ranks.group`; the other ranks run `instance.follower`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
from prometheus_client import REGISTRY, generate_latest

from disagg_worker.config import EngineConfig, Role
from disagg_worker.disagg import KVManager
from disagg_worker.engine import cuda_graphs
from disagg_worker.engine.assemble import build_kv_manager, build_stage
from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.drafting import Draft, load_draft
from disagg_worker.engine.expert_load import ExpertLoad
from disagg_worker.engine.grammar import Grammars
from disagg_worker.engine.grammar_wait import GrammarWait
from disagg_worker.engine.memory import return_freed_memory
from disagg_worker.engine.outbox import Outbox, internal_error
from disagg_worker.engine.pools import DTYPES, build_drafter, build_kv_pool, size_pool
from disagg_worker.engine.request import Req
from disagg_worker.engine.runner import ModelRunner
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.speculative import DraftPlanner
from disagg_worker.engine.tiers import build_tiers
from disagg_worker.keys import LOCAL_PREFILL, target_signed
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.radix import RadixCache
from disagg_worker.model.batch import ForwardBatch, empty_forward
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.loader import load_model
from disagg_worker.model.parallel import Shard
from disagg_worker.ranks.dist import Comm
from disagg_worker.ranks.group import Launched, RankGroup, StageWork
from disagg_worker.ranks.kv import RankedKV, RankTransfer
from disagg_worker.request import messages as msg
from disagg_worker.request.errors import INTERNAL_ERROR
from disagg_worker.request.limits import RequestLimits
from disagg_worker.request.params import SamplingParams
from disagg_worker.request.trail import Trail
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)

# A rank's consensus queues under the names its role's stage uses for them.
RANK_QUEUE_NAMES = {
    Role.PREFILL: {"bootstrap": "prefill_bootstrap", "inflight": "prefill_inflight"},
    Role.DECODE: {"bootstrap": "decode_prealloc", "inflight": "decode_transfer"},
}


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        model: torch.nn.Module | None,
        model_cfg: ModelConfig,
        comm: Comm | None = None,
        draft: Draft | None = None,
    ):
        self.cfg = cfg
        self.model_cfg = model_cfg
        cache = cfg.cache
        shard = comm.shard if comm is not None else Shard()
        self.shard = shard
        self.max_context_len = cfg.max_context_len or model_cfg.max_position_embeddings
        graphs = cuda_graphs.wanted(cfg, model, comm is None, draft is not None)  # a padding page after the rest:
        self.kv_pool = build_kv_pool(cfg, model_cfg, shard, draft, cache.total_pages + 1 if graphs else None)
        # Under DP attention every group's MoE layers see every group's tokens: the first group's counts say all.
        self.expert_load = ExpertLoad(model if shard.dp_rank == 0 else None, cfg.disagg.ep_size)
        self.allocator = PageAllocator(cache.total_pages)
        self.radix = RadixCache(
            cache.page_size,
            self.allocator,
            enabled=cfg.uses_prefix_cache,
            record_events=cfg.uses_prefix_cache,
            names_key=cfg.disagg.kv_names[0],
        )
        self.outbox = Outbox()
        # With several stages a request's next step waits for its token to come back.
        future_inputs = shard.pp_size == 1
        planner = DraftPlanner(cfg.scheduler.speculative) if cfg.drafts else None
        self.scheduler = Scheduler(
            cfg.scheduler,
            cache.page_size,
            self.allocator,
            self.radix,
            self.outbox,
            future_inputs=future_inputs,
            drafter=planner,
        )
        drafter = build_drafter(cfg, draft, self.kv_pool, model_cfg) if draft is not None else None
        self.runner = ModelRunner(model, self.kv_pool, model_cfg.vocab_size, cfg.device, drafter)
        if graphs:
            self.runner.graphs = cuda_graphs.captured(model, self.kv_pool, cache.total_pages, cfg, self.max_context_len)
        self.scheduler.tiers = self.tiers = build_tiers(cfg, self.kv_pool, drafter, self.radix, cfg.model_name)
        manager = build_kv_manager(cfg, self.kv_pool, shard, model_cfg, draft.fingerprint if draft else "")
        kv: KVManager | RankedKV | None = manager
        self.ranks: RankGroup | None = None
        if comm is not None:
            faulty = cfg.disagg.fault_fail_senders_on_stage == shard.pp_rank
            transfer = RankTransfer(manager, fail_new_senders=faulty) if manager is not None else None
            kv = RankedKV(transfer) if transfer is not None else None
            work = StageWork(comm, self.runner.forward, transfer, driver=True)
            self.ranks = RankGroup(comm, work, kv if isinstance(kv, RankedKV) else None)
        self.manager = manager
        self.runner.layer_stream = manager.layer_stream if manager is not None else None
        self.stage = build_stage(cfg, kv, self.scheduler, self.allocator, self.outbox, self.kv_pool.nbytes)
        self.limits = RequestLimits(self.max_context_len, model_cfg.vocab_size, cache.capacity_tokens)
        self.eos_ids = frozenset(model_cfg.eos_token_ids)
        self.grammars = Grammars(
            cfg.model_path, model_cfg.vocab_size, sorted(self.eos_ids), fault_pattern=cfg.fault_grammar_pattern
        )
        self.grammar_wait = GrammarWait(self.grammars, TUNING.engine.grammar_compile_limit_s)

    @classmethod
    def from_config(cls, cfg: EngineConfig, comm: Comm | None = None) -> Engine:
        torch.manual_seed(cfg.seed)
        shard = comm.shard if comm is not None else Shard()
        collectives = comm.collectives() if comm is not None else None
        model, model_cfg = load_model(
            cfg.model_path, DTYPES[cfg.dtype], cfg.device, shard, collectives, cfg.quantization
        )
        draft = load_draft(cfg, model, model_cfg)
        return_freed_memory()
        cfg = size_pool(cfg, model_cfg, shard, draft, comm)
        return cls(cfg, None if cfg.forward == "noop" else model, model_cfg, comm, draft)

    # ---- messages from the HTTP process -------------------------------------------------------
    def handle(self, m: msg.Message) -> None:
        """Act on one message. Taking a request is that request's business: if it raises, the request alone
        fails (a 500 naming its id, the traceback in the log) and the instance goes on."""
        if isinstance(m, msg.GenerateReq):
            try:
                self.arrive(m)
            except Exception:
                log.exception("request %s: taking it failed", m.rid)
                self.refuse(m, internal_error(m.rid, "taking the request"))
        elif isinstance(m, msg.AbortReq):
            self.abort(m.rid)
        elif isinstance(m, msg.FlushCacheReq):
            self.radix.evict(self.radix.total_pages)
        elif isinstance(m, msg.Wake):
            pass  # it ended the loop's wait: the step comes next
        else:
            log.warning("ignoring unexpected message %s", type(m).__name__)

    def arrive(self, m: msg.GenerateReq) -> None:
        problem = self.limits.kv_problem(len(m.input_ids))  # it would wait for pages forever
        if not problem:  # the HTTP process checked them with the same rules: refused here too, never sampled
            problem = m.params.problem(self.model_cfg.vocab_size)
        if not problem and m.params.grammar is not None:  # the request waits for its grammar (`tick`)
            self.grammar_wait.add(m)
            return
        self.enter(m, None, problem)

    def refuse(self, m: msg.GenerateReq, message: str) -> None:
        """End a request that never entered a queue with an internal error of its own (500)."""
        req = Req(rid=m.rid, prompt_ids=list(m.input_ids), params=SamplingParams())
        self.outbox.reject(req, 500, message, INTERNAL_ERROR)

    def _take_compiled(self) -> None:
        """Requests whose grammar wait is over go on to their queue, or are refused."""
        for r in self.grammar_wait.poll():
            if r.failed:
                self.refuse(r.m, internal_error(r.m.rid, "compiling its grammar"))
                continue
            try:
                self.enter(r.m, r.matcher, r.problem, r.status)
            except Exception:
                log.exception("request %s: taking it failed", r.m.rid)
                self.refuse(r.m, internal_error(r.m.rid, "taking the request"))

    def enter(self, m: msg.GenerateReq, matcher: object, problem: str, status: int = 400) -> None:
        """A request with its grammar's matcher (if any) to its queue, or refused with `problem` (`status`)."""
        req = Req(
            rid=m.rid,
            prompt_ids=list(m.input_ids),
            params=m.params,
            eos_ids=self.eos_ids,
            max_context_len=self.max_context_len,
            matcher=matcher,
            trail=Trail() if m.traced else None,
        )
        if m.resumed:
            req.sampling.skip(list(m.input_ids[-m.resumed :]))
            req.sampling.resumed = m.resumed
        if not problem and m.local_prefill and not self.cfg.takes_local_prefill:
            problem = f"this {self.cfg.disagg.role.value} instance does not compute prompts for local_prefill"
        key = self.cfg.disagg.target_key
        if not problem and m.local_prefill and key and not target_signed(key, LOCAL_PREFILL, 0, 0, m.local_sig):
            self.outbox.reject(req, 403, "local_prefill not signed by this model's router: refused")
        elif problem:
            self.outbox.reject(req, status, problem)
        elif self.stage is not None and not m.local_prefill:
            self.stage.arrive(req, m.bootstrap)
        else:
            self.scheduler.add(req)

    def abort(self, rid: str) -> None:
        if self.grammar_wait.abort(rid):
            return
        if self.stage is None or not self.stage.abort(rid):
            self.scheduler.abort(rid)

    # ---- stepping (instance.loop) -------------------------------------------------------------
    def tick(self) -> None:
        """Advance whatever does not need the model (grammars, P/D queues); called before each schedule."""
        if self.grammar_wait:
            self._take_compiled()
        if self.stage is not None:
            self.stage.tick()

    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def needs_sync(self) -> bool:
        return self.scheduler.needs_sync()

    def run(self, batch: ScheduledBatch) -> StepResult:
        """The forward and sampling of one batch (on the runner thread with overlap: decode steps only)."""
        if self.stage is not None and not batch.forward.is_decode:
            self.stage.before_forward(batch)
        return self.runner.run(batch)

    @property
    def multi_rank(self) -> bool:
        return self.ranks is not None

    def any_group_forwards(self, batch: ScheduledBatch | None) -> bool:
        """DP attention: whether any attention group runs a forward this step (then every group must, an
        idle one over no tokens: the MLPs' collectives span them all). Every group's driver asks once a step."""
        if self.ranks is None:
            return batch is not None
        return self.ranks.comm.any_group(batch is not None)

    @property
    def dp_attention(self) -> bool:
        return self.shard.dp_size > 1

    @property
    def depth(self) -> int:
        """Steps that may stay in flight after one is launched (multi-rank: one per later stage)."""
        return self.ranks.depth if self.ranks is not None else 0

    def launch(self, batch: ScheduledBatch | None, idle: ForwardBatch | None = None) -> Launched:
        """Start a step on every rank: `batch`'s forward (without one, `idle` or none) and a transfer round."""
        if self.ranks is None:
            raise RuntimeError("launch() is for multi-rank engines; use run()")
        if self.stage is not None and batch is not None:
            self.stage.before_forward(batch)  # its commands go to every rank with this step
        return self.ranks.launch(batch.forward if batch is not None else idle)

    def launch_forward(self, batch: ScheduledBatch | None) -> Launched:
        """DP attention: start a step that runs the forward on every rank, over no tokens without a batch."""
        return self.launch(batch, empty_forward())

    def finish(self, batch: ScheduledBatch | None, launched: Launched) -> None:
        """Wait for a launched step's logits, sample, and process the result."""
        if self.ranks is None:
            raise RuntimeError("finish() is for multi-rank engines")
        logits = self.ranks.collect(launched)
        if batch is not None and logits is not None:
            self.process(batch, self.runner.sample(batch, logits))

    def process(self, batch: ScheduledBatch, result: StepResult) -> None:
        outcome = self.scheduler.process(batch, result)
        if self.stage is not None:
            if outcome.chunks or outcome.handed_off:  # pages about to go to the transfer: written first
                self.runner.wait_kv_written()
            self.stage.on_step(outcome)

    def take_outputs(self) -> list[msg.TokenOut]:
        return self.outbox.take()

    @property
    def has_batch_work(self) -> bool:
        """A forward could be scheduled now."""
        return not self.scheduler.idle

    @property
    def waiting_on_transfers(self) -> bool:
        """Requests wait on KV transfers (P/D roles), or the other ranks have yet to hear how some
        ended; the loop polls often."""
        if self.ranks is not None and self.ranks.has_news:
            return True
        return self.stage is not None and self.stage.waiting_on_transfers

    @property
    def idle(self) -> bool:
        """Nothing to do until a message arrives."""
        return self.scheduler.idle and not self.waiting_on_transfers and not self.grammar_wait

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake` is called, from any thread, when a KV transfer or a grammar this engine waits on moves."""
        self.grammar_wait.wake = wake
        if self.tiers is not None:
            self.tiers.wake = wake
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
            dp_rank=self.shard.dp_rank,
        )

    def stats(self) -> msg.SchedulerStats:
        self.expert_load.publish()
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
            prompt_tokens_computed=s.prompt_tokens_computed,
            pages_taken_in_flight=s.in_flight.taken_while_written,
            pid=os.getpid(),
            queues=self.queue_sizes(),
            rank_queues=self.rank_queue_sizes(),
            metrics_text=own_metrics(),
            dp_rank=self.shard.dp_rank,
            kv_events=tuple(self.radix.take_events() + (self.tiers.take_events() if self.tiers else [])),
            broken=self.manager.broken if self.manager is not None else "",
        )

    def queue_sizes(self) -> dict[str, int]:
        """Sizes of the P/D queues (none for a monolithic instance)."""
        return self.stage.queue_sizes() if self.stage is not None else {}

    def rank_queue_sizes(self) -> dict[tuple[int, int], dict[str, int]]:
        """Every rank's queue sizes (multi-rank P/D): this rank's stage queues, and for the others
        the last sizes they reported. The tensor ranks of a stage hold the same rooms, in the same
        queues (they apply the same commands to the same agreed states)."""
        if self.stage is None:
            return {}
        if self.ranks is None:
            return {(0, 0): self.queue_sizes()}
        names = RANK_QUEUE_NAMES[self.cfg.disagg.role]
        shard = self.shard
        group = range(shard.dp_rank * shard.attn_tp_size, (shard.dp_rank + 1) * shard.attn_tp_size)  # this group's
        sizes = {
            (tp, pp): {names[q]: n for q, n in stage.items()} for pp, stage in self.ranks.queues.items() for tp in group
        }
        sizes[(group.start, 0)] = self.queue_sizes()
        return sizes

    def close(self) -> None:
        """Stop the other ranks and release what the engine holds outside this process."""
        self.grammars.close()
        if self.tiers is not None:
            self.tiers.close()
        if self.ranks is not None:
            self.ranks.stop()
        if self.stage is not None:
            self.stage.close()

    def pages_accounted(self) -> bool:
        """At idle, every page is free or held unlocked by the prefix cache."""
        a = self.allocator
        return a.num_free + self.radix.total_pages == a.num_total and self.radix.total_refs() == 0


def own_metrics() -> str:
    """This process's `disagg_*` Prometheus series (the HTTP process serves them on /metrics)."""
    text = generate_latest(REGISTRY).decode()
    keep = [line for line in text.splitlines() if line.startswith(("disagg_", "# HELP disagg_", "# TYPE disagg_"))]
    return "\n".join(keep) + ("\n" if keep else "")
