"""How an engine's steps are computed: the executor the loop's one stepper launches batches on.

A step is launched (its forward started), then collected (its tokens sampled and returned); in between the
stepper schedules the next one. How many steps may stay in flight once one is launched is the executor's
`depth`. Two executors share this interface:
- `LocalExecutor` (here): one rank in this process. With overlap a decode step's forward runs on a forward
  thread while the next step is scheduled (depth 1); a step with prompt chunks, or any step without overlap,
  runs on the loop's thread when launched (depth 0).
- `ranks.executor.RankExecutor`: the ranks of a multi-rank instance, one step on every rank, up to one step
  in flight per later pipeline stage; it also runs the steps without a batch that the ranks need (a KV
  transfer round, a heartbeat, an idle forward under DP attention).
An asynchronous launch on a GPU stream is a third: launch enqueues, collect synchronises.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, cast

from disagg_worker.config import Role
from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.runner import ModelRunner
from disagg_worker.model.parallel import Shard
from disagg_worker.ranks.group import Launched, RankGroup


class Executor(Protocol):
    """What the engine launches its steps on."""

    def depth(self, batch: ScheduledBatch | None, waiting: bool) -> int:
        """Steps that may stay in flight once `batch` (None: no batch) is launched. `waiting`: requests wait on
        KV transfers. The stepper finishes older steps down to this depth before and after the launch."""

    def launch(self, batch: ScheduledBatch | None, waiting: bool) -> object | None:
        """Start a step over `batch`; without a batch, the step the executor itself needs (None: none)."""

    def collect(self, batch: ScheduledBatch | None, launched: object) -> StepResult | None:
        """Wait for `batch`'s launched step and sample it (None: it had no batch)."""

    @property
    def has_news(self) -> bool:
        """Something the next step must carry even without a batch (the loop polls often)."""

    @property
    def computing(self) -> bool:
        """A step must run next even without a batch of this engine's (DP attention: another group's)."""

    def nudge(self) -> None:
        """A message arrived while idle: wake whoever this executor's next step waits for."""

    def rank_queues(self, own: dict[str, int]) -> dict[tuple[int, int], dict[str, int]]:
        """Every rank's P/D queue sizes by (tensor rank, pipeline stage), this rank's being `own`."""

    def close(self) -> None:
        """Stop the executor's threads or ranks."""


class LocalExecutor:
    """One rank in this process: inline, or with overlap a decode step's forward on the forward thread."""

    def __init__(self, runner: ModelRunner, overlap: bool):
        self.runner = runner
        self.overlap = overlap
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    def depth(self, batch: ScheduledBatch | None, waiting: bool) -> int:
        return 1 if batch is not None and self._threaded(batch) else 0

    def _threaded(self, batch: ScheduledBatch) -> bool:
        """A hand-off to the forward thread costs more than it saves for a step with prompt chunks (loop.py)."""
        return self.overlap and batch.forward.is_decode

    def launch(self, batch: ScheduledBatch | None, waiting: bool) -> Future[StepResult] | StepResult | None:
        if batch is None:
            return None
        if self._threaded(batch):
            return self.pool.submit(self.runner.run, batch)
        return self.runner.run(batch)

    def collect(self, batch: ScheduledBatch | None, launched: object) -> StepResult | None:
        if isinstance(launched, Future):
            return cast(StepResult, launched.result())
        return launched if isinstance(launched, StepResult) else None

    has_news = False
    computing = False

    def nudge(self) -> None:
        return None

    def rank_queues(self, own: dict[str, int]) -> dict[tuple[int, int], dict[str, int]]:
        return {(0, 0): own}

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# A rank's consensus queues under the names its role's stage uses for them.
RANK_QUEUE_NAMES = {
    Role.PREFILL: {"bootstrap": "prefill_bootstrap", "inflight": "prefill_inflight"},
    Role.DECODE: {"bootstrap": "decode_prealloc", "inflight": "decode_transfer"},
}


class RankExecutor:
    """The ranks of a multi-rank instance (`ranks.group`): each step runs on every rank, the last stage's
    logits come back to this driver, which samples them."""

    def __init__(self, group: RankGroup, runner: ModelRunner, shard: Shard, role: Role):
        self.group = group
        self.runner = runner
        self.shard = shard
        self.names = RANK_QUEUE_NAMES.get(role, {})

    def depth(self, batch: ScheduledBatch | None, waiting: bool) -> int:
        return self.group.depth_for(batch is not None, waiting)

    def launch(self, batch: ScheduledBatch | None, waiting: bool) -> Launched | None:
        return self.group.start(batch.forward if batch is not None else None, waiting)

    def collect(self, batch: ScheduledBatch | None, launched: object) -> StepResult | None:
        if not isinstance(launched, Launched):
            raise TypeError(f"not a launched step: {launched!r}")
        logits = self.group.collect(launched)
        return None if batch is None or logits is None else self.runner.sample(batch, logits)

    @property
    def has_news(self) -> bool:
        return self.group.has_news

    @property
    def computing(self) -> bool:
        return self.group.groups_forward

    def nudge(self) -> None:
        self.group.peers.wake()

    def rank_queues(self, own: dict[str, int]) -> dict[tuple[int, int], dict[str, int]]:
        """Every rank's queue sizes: this rank's stage queues (`own`), and for the others the last sizes they
        reported. The tensor ranks of a stage hold the same rooms, in the same queues (they apply the same
        commands to the same agreed states)."""
        shard = self.shard
        group = range(shard.dp_rank * shard.attn_tp_size, (shard.dp_rank + 1) * shard.attn_tp_size)  # this group's
        sizes = {
            (tp, pp): {self.names[q]: n for q, n in stage.items()}
            for pp, stage in self.group.queues.items()
            for tp in group
        }
        sizes[(group.start, 0)] = own
        return sizes

    def close(self) -> None:
        self.group.stop()
