"""The engine of one instance: it takes requests, schedules their steps, processes what each step sampled, and reports.

Every role runs the same engine over parts `engine.assemble` builds: the KV pool and prefix cache, the
scheduler, the runner, the executor its steps run on (`engine.executor`: this process's forward thread, or
every rank of a multi-rank instance), and its role's stage (`engine.prefill`, `engine.decode`, or
`engine.monolithic`'s, which holds nothing), which owns the KV transfer queues. The loop (`instance.loop`)
drives it through `handle` (requests and aborts) and the step methods (`tick`, `schedule`, `launch`,
`finish`); the engine routes each to the part that owns it. Nothing here depends on how many ranks there are.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY, generate_latest

from disagg_worker.config import EngineConfig
from disagg_worker.disagg import KVManager
from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.executor import Executor
from disagg_worker.engine.expert_load import ExpertLoad
from disagg_worker.engine.grammar import Grammars
from disagg_worker.engine.grammar_wait import GrammarWait
from disagg_worker.engine.lora_registry import LoraRegistry, adapter_names
from disagg_worker.engine.monolithic import MonolithicStage
from disagg_worker.engine.outbox import Outbox, internal_error
from disagg_worker.engine.prefix_tiers import NoTiers
from disagg_worker.engine.request import Req
from disagg_worker.engine.runner import ModelRunner
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.stage import RoleStage
from disagg_worker.engine.tiers import KVTiers
from disagg_worker.keys import LOCAL_PREFILL, target_signed
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.radix import RadixCache
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import Shard
from disagg_worker.request import messages as msg
from disagg_worker.request.errors import INTERNAL_ERROR
from disagg_worker.request.limits import RequestLimits
from disagg_worker.request.params import SamplingParams
from disagg_worker.request.trail import NO_TRAIL, Trail
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an engine steps with, each made with its collaborators by `engine.assemble.build_engine`."""

    shard: Shard
    max_context_len: int
    kv_pool: KVPool
    allocator: PageAllocator
    radix: RadixCache
    outbox: Outbox
    scheduler: Scheduler
    runner: ModelRunner
    executor: Executor
    stage: RoleStage | MonolithicStage
    tiers: KVTiers | NoTiers
    manager: KVManager | None  # this rank's KV transfer manager (P/D roles)
    expert_load: ExpertLoad


class Engine:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, parts: EngineParts):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.shard = parts.shard
        self.max_context_len = parts.max_context_len
        self.kv_pool = parts.kv_pool
        self.allocator = parts.allocator
        self.radix = parts.radix
        self.outbox = parts.outbox
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.executor = parts.executor
        self.stage = parts.stage
        self.tiers = parts.tiers
        self.manager = parts.manager
        self.expert_load = parts.expert_load
        self.limits = RequestLimits(self.max_context_len, model_cfg.vocab_size, cfg.cache.capacity_tokens)
        self.eos_ids = frozenset(model_cfg.eos_token_ids)
        self.grammars = Grammars(
            cfg.model_path, model_cfg.vocab_size, sorted(self.eos_ids), fault_pattern=cfg.fault_grammar_pattern
        )
        self.grammar_wait = GrammarWait(self.grammars, TUNING.engine.grammar_compile_limit_s)
        self.loras = LoraRegistry(cfg.lora)

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
            problem = m.params.problem(self.model_cfg.vocab_size) or self.loras.problem(m.params.lora)
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
            trail=Trail() if m.traced else NO_TRAIL,
            lora_adapter=self.loras.adapter(m.params.lora),
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
        elif m.local_prefill:
            self.scheduler.add(req)
        else:
            self.stage.arrive(req, m.bootstrap)

    def abort(self, rid: str) -> None:
        if self.grammar_wait.abort(rid):
            return
        if not self.stage.abort(rid):
            self.scheduler.abort(rid)

    # ---- stepping (instance.loop) -------------------------------------------------------------
    def tick(self) -> None:
        """Advance whatever does not need the model (grammars, P/D queues); called before each schedule."""
        if self.grammar_wait:
            self._take_compiled()
        self.stage.tick()

    def schedule(self) -> ScheduledBatch | None:
        return self.scheduler.schedule()

    def needs_sync(self) -> bool:
        return self.scheduler.needs_sync()

    def depth(self, batch: ScheduledBatch | None) -> int:
        """Steps that may stay in flight once `batch` is launched (`engine.executor`)."""
        return self.executor.depth(batch, self.waiting_on_transfers)

    def launch(self, batch: ScheduledBatch | None) -> object | None:
        """Start a step over `batch` (or, without one, the step the executor needs; None: none started)."""
        if batch is not None and not batch.forward.is_decode:
            self.stage.before_forward(batch)  # prefill arms the streams of the pages this forward completes
        return self.executor.launch(batch, self.waiting_on_transfers)

    def finish(self, batch: ScheduledBatch | None, launched: object) -> None:
        """Wait for a launched step, sample it, and process the result."""
        result = self.executor.collect(batch, launched)
        if batch is not None and result is not None:
            self.process(batch, result)

    def run(self, batch: ScheduledBatch) -> StepResult:
        """The forward and sampling of one batch, waited for (benchmarks and tests step the engine by hand)."""
        result = self.executor.collect(batch, self.executor.launch(batch, False))
        if result is None:
            raise RuntimeError("a launched batch came back without its tokens")
        return result

    def process(self, batch: ScheduledBatch, result: StepResult) -> None:
        self.stage.on_step(self.scheduler.process(batch, result))

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
        return self.executor.has_news or self.stage.waiting_on_transfers

    @property
    def computing(self) -> bool:
        """A step runs next even without a batch of this engine's (DP attention: another group forwards)."""
        return self.executor.computing

    def nudge(self) -> None:
        """A message arrived while idle: wake the other attention groups this engine steps with."""
        self.executor.nudge()

    @property
    def idle(self) -> bool:
        """Nothing to do until a message arrives."""
        return self.scheduler.idle and not self.waiting_on_transfers and not self.grammar_wait

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake` is called, from any thread, when a KV transfer or a grammar this engine waits on moves."""
        self.grammar_wait.wake = wake
        self.tiers.wake = wake
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
            kv_events=tuple(self.radix.take_events() + self.tiers.take_events()),
            broken=self.manager.broken if self.manager is not None else "",
            lora_running=adapter_names(s.running),
            lora_waiting=adapter_names(s.waiting),
            lora_resident=self.loras.names(s.adapters.resident()),
        )

    def queue_sizes(self) -> dict[str, int]:
        """Sizes of the P/D queues (none for a monolithic instance)."""
        return self.stage.queue_sizes()

    def rank_queue_sizes(self) -> dict[tuple[int, int], dict[str, int]]:
        """Every rank's P/D queue sizes (none for a monolithic instance)."""
        own = self.queue_sizes()
        return self.executor.rank_queues(own) if own else {}

    def close(self) -> None:
        """Stop the other ranks and release what the engine holds outside this process."""
        self.grammars.close()
        self.tiers.close()
        self.executor.close()
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
