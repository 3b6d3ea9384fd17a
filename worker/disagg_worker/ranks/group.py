"""The steps of a multi-rank instance: one rank schedules, every rank computes its slice.

The driver (tensor rank 0 of pipeline stage 0) owns the scheduler and, in a P/D role, the role
stage. Each step it sends every other rank a `Step`: the forward to run (or none), the transfer
commands its stage issued since the last step, and the consensus results that came back since.
Stage 0's ranks get it by a broadcast; each later stage gets it, with the hidden states, from the
stage before (tensor rank t from tensor rank t). Every rank then applies the commands to its own
transfer handles, polls them (the minimum over the stage's tensor ranks), takes its part in the
round of the consensus (ranks/consensus.py) and runs its layers; the last stage's tensor rank 0
sends the logits and the round's result back to the driver, which samples.

With one stage the whole step happens inside `launch`. With several, up to `pp_size` steps are in
flight, one per stage, so no stage waits for the others by construction; a request is never in two
of them at once (the scheduler skips requests whose token is still being computed).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_worker.disagg import KVPoll
from disagg_worker.model.batch import ForwardBatch, empty_forward
from disagg_worker.ranks.consensus import Round
from disagg_worker.ranks.dist import Comm, Posted
from disagg_worker.ranks.kv import Command, RankedKV, RankTransfer
from disagg_worker.ranks.peers import Peers
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)


@dataclass
class Step:
    """What the driver sends every other rank, once per step."""

    plan: ForwardBatch | None = None
    commands: list[Command] = field(default_factory=list)
    results: list[Round] = field(default_factory=list)  # settled by stage 0's ranks before proposing
    stop: bool = False


@dataclass
class StageOutput:
    """What one stage hands the next (and the last stage the driver), beside the tensor."""

    step: Step
    round: Round | None
    unsafe: frozenset[int] = frozenset()
    queues: dict[int, dict[str, int]] = field(default_factory=dict)  # by pp_rank


class StageWork:
    """One rank's side of a step: commands, polls, its part of the consensus, its layers.

    The driver applied its commands when it issued them and settles results through its
    `RankedKV`; every other rank does both here."""

    def __init__(
        self,
        comm: Comm,
        forward: Callable[[ForwardBatch, torch.Tensor | None], torch.Tensor],
        transfer: RankTransfer | None,
        driver: bool,
        drain_local_failures: bool = True,
    ):
        self.comm = comm
        self.forward = forward  # (plan, hidden of the stage before or None) -> hidden or logits
        self.transfer = transfer
        self.driver = driver
        self.drain_local_failures = drain_local_failures

    def run(self, step: Step, prev: StageOutput | None, hidden: torch.Tensor | None) -> tuple[StageOutput, Any]:
        rnd, unsafe, queues = None, frozenset[int](), dict(prev.queues) if prev else {}
        if self.transfer is not None:
            rnd, unsafe = self._transfer_round(step, prev)
            queues[self.comm.shard.pp_rank] = self.transfer.queue_sizes()
        out = self.forward(step.plan, hidden) if step.plan is not None else None
        return StageOutput(step, rnd, unsafe, queues), out

    def _transfer_round(self, step: Step, prev: StageOutput | None) -> tuple[Round, frozenset[int]]:
        t = self.transfer
        if t is None:
            raise RuntimeError("a transfer round on a rank without KV transfer")
        first = self.comm.shard.first_stage
        if not self.driver:
            for result in step.results if first else ():
                t.settle(result)
            for cmd in step.commands:
                t.apply(cmd)
        rooms = t.rooms()
        polls = self.comm.min_in_stage(t.local_polls(rooms))
        states = {r: KVPoll(p) for r, p in zip(rooms, polls, strict=True)}
        rnd = t.round(states, None if first else prev.round if prev else Round(), self.drain_local_failures)
        if first and self.comm.shard.pp_size == 1 and not self.driver:
            t.settle(rnd)  # one stage: the proposal is the result (the driver settles it itself)
        unsafe = set(prev.unsafe) if prev else set()
        unsafe |= self.comm.union_in_stage(t.unsafe_rooms())
        return rnd, frozenset(unsafe)


@dataclass
class Launched:
    """A step the driver started: its result comes back with `RankGroup.collect`."""

    logits: torch.Tensor | None = None
    output: StageOutput | None = None
    pending: bool = False
    posted: Posted | None = None  # the driver's send to the next stage, completing in the background


class RankGroup:
    """The driver's side: starts steps on every rank and collects what comes back.

    A step without a batch still runs while requests wait on KV transfers (its transfer round), and every
    `heartbeat_s` when idle, so that every rank hears from the others and a dead or hung one fails the instance
    (its collective breaks, or waits past --dist-timeout) instead of hiding. With DP attention the attention
    groups step together: before each step their drivers agree whether any group runs a forward; if one does,
    every group does (over no tokens when it has no batch), since the MLP layers gather every group's tokens. A
    driver with something to do wakes the others first (`peers`); while any group forwards, none sleeps."""

    def __init__(
        self,
        comm: Comm,
        work: StageWork,
        kv: RankedKV | None,
        peers: Peers | None = None,
        heartbeat_s: float = TUNING.engine.rank_heartbeat_s,
    ):
        self.comm = comm
        self.work = work
        self.kv = kv
        self.peers = peers if peers is not None else Peers([])
        self.heartbeat_s = heartbeat_s
        self.last_launch = time.monotonic()
        self.groups_forward = False  # DP attention: the last step ran a forward in some group
        self.results: list[Round] = []  # came back since the last step; stage 0's ranks settle them
        self.inflight: deque[Launched] = deque()
        self.queues: dict[int, dict[str, int]] = {}  # the last known queue sizes of every stage
        shard = comm.shard
        self.next_rank = shard.world_rank + shard.tp_size if not shard.last_stage else None
        self.last_root = (shard.pp_size - 1) * shard.tp_size

    @property
    def has_news(self) -> bool:
        """Released or failed rooms that the other stages have not heard of yet."""
        q = self.kv.local.queues if self.kv is not None else None
        return q is not None and bool(q.released or q.failed)

    @property
    def depth(self) -> int:
        """Steps that may stay in flight after a step was started: one per later stage."""
        return self.comm.shard.pp_size - 1

    def depth_for(self, plan: bool, waiting: bool) -> int:
        """Steps that may stay in flight once a step is started: with a batch (`plan`) or a transfer round
        (`waiting`), `depth`; an idle step finishes everything before it."""
        return self.depth if plan or waiting else 0

    def start(self, plan: ForwardBatch | None, waiting: bool) -> Launched | None:
        """Start the next step: `plan`'s forward, or without one the step the ranks need now (a transfer round
        when `waiting`, a heartbeat when due, an idle forward when another attention group forwards); None when
        none is needed."""
        now = time.monotonic()
        if self.comm.shard.dp_size > 1:
            if not self.groups_forward and (plan is not None or waiting):
                self.peers.wake()  # they may sleep until their next report; this step needs them now
            self.groups_forward = self.comm.any_group(plan is not None)
            if self.groups_forward:
                self.last_launch = now
                return self.launch(plan if plan is not None else empty_forward())
        if plan is None and not waiting and now - self.last_launch < self.heartbeat_s:
            return None
        self.last_launch = now
        return self.launch(plan)

    def launch(self, plan: ForwardBatch | None) -> Launched:
        commands = self.kv.take_commands() if self.kv is not None else []
        step = Step(plan, commands, self.results)
        self.results = []
        self.comm.broadcast_in_stage(step)
        output, out = self.work.run(step, None, None)
        if self.next_rank is None:  # one stage: done
            self._settle(output)
            return Launched(logits=out, output=output)
        # Posted, not sent: the next stage may be busy handing a result back to this rank.
        launched = Launched(pending=True, posted=self.comm.post_to(self.next_rank, output, out))
        self.inflight.append(launched)
        return launched

    def collect(self, launched: Launched) -> torch.Tensor | None:
        """The logits of a launched step (blocks for the last stage's answer)."""
        while launched.pending:
            oldest = self.inflight.popleft()
            output, logits = self.comm.recv_from(self.last_root)
            if oldest.posted is not None:
                oldest.posted.wait()
            oldest.output, oldest.logits, oldest.pending = output, logits, False
            if output.round is not None:
                self.results.append(output.round)
            self._settle(output)
        return launched.logits

    def _settle(self, output: StageOutput) -> None:
        self.queues.update(output.queues)
        if self.kv is not None and output.round is not None:
            self.kv.settle(output.round, set(output.unsafe))

    def stop(self) -> None:
        step = Step(stop=True)
        self.comm.broadcast_in_stage(step)
        if self.next_rank is not None:
            self.comm.send_to(self.next_rank, StageOutput(step, None))
        self.peers.close()


def follow(comm: Comm, work: StageWork) -> None:
    """A rank that does not schedule: run every step the driver sends until told to stop."""
    shard = comm.shard
    prev_rank = shard.world_rank - shard.tp_size if not shard.first_stage else None
    next_rank = shard.world_rank + shard.tp_size if not shard.last_stage else None
    driver = 0
    while True:
        if prev_rank is None:
            step, prev, hidden = comm.broadcast_in_stage(None), None, None
        else:
            prev, hidden = comm.recv_from(prev_rank)
            step = prev.step
        if step.stop:
            if next_rank is not None:
                comm.send_to(next_rank, StageOutput(step, None))
            return
        output, out = work.run(step, prev, hidden)
        if next_rank is not None:
            comm.send_to(next_rank, output, out)
        elif shard.tp_rank == 0 and shard.pp_size > 1:
            comm.send_to(driver, output, out)
