"""The scheduler process: receive requests, step the engine, send tokens back.

One loop with an explicit overlap switch. With overlap on, step N+1 is scheduled and its tensors
built on this thread while step N's forward runs on the runner thread; step N's results are then
processed while N+1 runs. With overlap off, each step is scheduled, run and processed in turn.
Overlap pays for short forwards (decode steps), whose scheduling would otherwise be a large part
of the step. A batch with a prompt chunk runs inline even with overlap on: the ~1 ms of scheduling
it could hide is small against a chunk's forward, and on CPU the runner thread made that forward
slower (GIL hand-offs, and the thread's malloc arena giving activations back to the kernel: ~900
page faults per 1k-token prefill on the runner thread vs ~70 inline).

While requests wait on KV transfers (P/D roles) the loop sleeps on its inbox and an eventfd that
the transfer layer signals on every status move, so it reacts at once; it still polls every
`transfer_poll_ms` (tuning.py) for what no status move announces (pages freed by finished requests).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import zmq

from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.engine import Engine
from disagg_worker.ranks.group import Launched
from disagg_worker.request import messages as msg
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)

LOOP = TUNING.engine


class Steppable(Protocol):
    """What the stepper drives (the engine): the step's parts, in the order it calls them."""

    def tick(self) -> None: ...
    def needs_sync(self) -> bool: ...
    def schedule(self) -> ScheduledBatch | None: ...
    def run(self, batch: ScheduledBatch) -> StepResult: ...
    def process(self, batch: ScheduledBatch, result: StepResult) -> None: ...

    @property
    def has_batch_work(self) -> bool: ...

    @property
    def idle(self) -> bool: ...


class Stepper:
    """Steps the engine with or without overlap; the scheduling logic lives in the Scheduler."""

    def __init__(self, engine: Steppable, overlap: bool, after_tick: Callable[[], None] = lambda: None):
        """`after_tick` runs between the engine's tick and the next forward: tokens the tick
        produced (decode's first token, landed by a KV transfer) go out without waiting a step."""
        self.engine = engine
        self.overlap = overlap
        self.after_tick = after_tick
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.inflight: tuple[ScheduledBatch, Future] | None = None

    @property
    def busy(self) -> bool:
        return self.inflight is not None or not self.engine.idle

    @property
    def computing(self) -> bool:
        """A forward is running or could be scheduled now."""
        return self.inflight is not None or self.engine.has_batch_work

    def step(self) -> None:
        """One turn: schedule the next batch, start it, and finish the one before it."""
        engine = self.engine
        engine.tick()
        self.after_tick()
        if self.inflight is not None and (not self.overlap or engine.needs_sync()):
            self.drain()
        batch = engine.schedule()
        if batch is None:
            self.drain()
        elif not self.overlap or not batch.forward.is_decode:  # inline: a hand-off costs more than it saves
            self.drain()
            engine.process(batch, engine.run(batch))
        else:
            started = self.pool.submit(engine.run, batch)
            self.drain()
            self.inflight = (batch, started)

    def drain(self) -> None:
        """Wait for the step in flight and process its results."""
        if self.inflight is None:
            return
        batch, fut = self.inflight
        self.inflight = None
        self.engine.process(batch, fut.result())

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)


class RankStepper:
    """Steps a multi-rank engine: each step runs on every rank (ranks.group), up to `depth`
    steps stay in flight (one per later pipeline stage), and a step without a batch still runs
    a transfer round while requests wait on KV transfers.

    With DP attention every attention group's driver runs one, and they step together: before each
    step they agree whether any group runs a forward; if one does, every group does (over no tokens
    when it has no batch), since the MLP layers gather every group's tokens. A driver with something
    to do wakes the others first (`wake_peers`: they may be asleep on their inboxes until their next
    report is due); while any group forwards, none sleeps."""

    def __init__(
        self,
        engine: Engine,
        after_tick: Callable[[], None] = lambda: None,
        wake_peers: Callable[[], None] = lambda: None,
    ):
        self.engine = engine
        self.after_tick = after_tick
        self.wake_peers = wake_peers
        self.inflight: deque[tuple[ScheduledBatch | None, Launched]] = deque()
        self.last_launch = time.monotonic()
        self.groups_forward = False  # DP attention: the last step ran a forward in some group

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or not self.engine.idle

    @property
    def computing(self) -> bool:
        return bool(self.inflight) or self.engine.has_batch_work or self.groups_forward

    def step(self) -> None:
        engine = self.engine
        engine.tick()
        self.after_tick()
        if self.inflight and engine.needs_sync():
            self.drain()
        batch = engine.schedule()
        if engine.dp_attention:
            if not self.groups_forward and (batch is not None or engine.waiting_on_transfers):
                self.wake_peers()  # they may sleep until their next report; this step needs them now
            self.groups_forward = engine.any_group_forwards(batch)
            if self.groups_forward:
                self.last_launch = time.monotonic()
                engine.finish(batch, engine.launch_forward(batch))  # one stage: done when launched
                return
        if batch is None and not engine.waiting_on_transfers:
            self.drain()
            if time.monotonic() - self.last_launch < LOOP.rank_heartbeat_s:
                return
            # Idle: an empty step every so often, so that every rank hears from the others and a dead or hung
            # one fails the instance (its collective breaks, or waits past --dist-timeout) instead of hiding.
        self.last_launch = time.monotonic()
        self.inflight.append((batch, engine.launch(batch)))
        while len(self.inflight) > engine.depth:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        batch, launched = self.inflight.popleft()
        self.engine.finish(batch, launched)

    def drain(self) -> None:
        while self.inflight:
            self._finish_oldest()

    def close(self) -> None:
        self.drain()


class EngineLoop:
    def __init__(self, engine: Engine, recv_addr: str, send_addr: str, overlap: bool, peers: list[str] | None = None):
        """`peers`: the inboxes of the other attention groups' schedulers (DP attention)."""
        self.engine = engine
        self.ctx = zmq.Context()
        self.peers = []
        for addr in peers or []:
            peer = self.ctx.socket(zmq.PUSH)
            peer.setsockopt(zmq.SNDHWM, 4)  # one pending wake-up is as good as many
            peer.connect(addr)
            self.peers.append(peer)
        self.stepper: Stepper | RankStepper
        if engine.multi_rank:  # every rank runs each step in turn: no forward thread
            self.stepper = RankStepper(engine, after_tick=self._send_outputs, wake_peers=self._wake_peers)
        else:
            self.stepper = Stepper(engine, overlap, after_tick=self._send_outputs)
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(recv_addr)
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.connect(send_addr)
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.poller = zmq.Poller()
        self.poller.register(self.recv, zmq.POLLIN)
        self.poller.register(self.wake_fd, zmq.POLLIN)
        engine.set_wakeup(self._wake)
        self.last_stats = 0.0
        self.stopped = False
        self.parent = os.getppid()

    def publish(self, m: msg.Message) -> None:
        self.send.send(msg.encode(m))

    def serve_forever(self) -> None:
        self.publish(self.engine.info())
        while not self.stopped:
            news = self._drain_inbox(self._wait_ms())
            if news and not self.stepper.computing:
                # DP attention: the other groups may sleep until their next report, and this one is about to wait
                # for them in its next step whatever the message was (a request, or an abort that makes no work).
                self._wake_peers()
            self.stepper.step()
            self._flush()

    def _wait_ms(self) -> int:
        if self.stepper.computing:
            return 0
        if self.engine.waiting_on_transfers:
            return LOOP.transfer_poll_ms
        return int(LOOP.stats_interval_s * 1000)

    def _wake_peers(self) -> None:
        for peer in self.peers:
            try:
                peer.send(msg.encode(msg.Wake()), zmq.NOBLOCK)
            except zmq.Again:  # wake-ups already queued there
                pass

    def _wake(self) -> None:
        """Any thread: a transfer moved; end the current wait."""
        os.eventfd_write(self.wake_fd, 1)

    def _drain_inbox(self, timeout: int) -> bool:
        """Handle every queued message, waiting up to `timeout` ms for the first message or a wake-up; whether a
        message other than another group's `Wake` came."""
        news = False
        while True:
            ready = dict(self.poller.poll(timeout))
            if self.wake_fd in ready:
                try:
                    os.eventfd_read(self.wake_fd)
                except BlockingIOError:
                    pass
            if self.recv not in ready:
                return news
            m = msg.decode(self.recv.recv())
            news = news or not isinstance(m, msg.Wake)
            self.engine.handle(m)
            timeout = 0

    def _send_outputs(self) -> None:
        outs = self.engine.take_outputs()
        if outs:
            self.publish(msg.BatchOut(outs))

    def _flush(self) -> None:
        self._send_outputs()
        now = time.monotonic()
        if now - self.last_stats >= LOOP.stats_interval_s:
            self.last_stats = now
            self.publish(self.engine.stats())
            if os.getppid() != self.parent:  # the HTTP process is gone: nobody can use our output
                log.warning("the server process exited; stopping")
                self.stopped = True

    def close(self) -> None:
        self.stopped = True
        self.stepper.close()
        self.recv.close(0)
        self.send.close(0)
        for peer in self.peers:
            peer.close(0)
        self.ctx.term()
        os.close(self.wake_fd)
