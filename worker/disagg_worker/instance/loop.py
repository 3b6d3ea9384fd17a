"""The scheduler process: receive requests, step the engine, send tokens back.

One loop and one stepper; how deep its pipeline of launched steps is depends on the engine's executor
(`engine.executor`). With overlap on, step N+1 is scheduled and its tensors built on this thread while
step N's forward runs on the forward thread; step N's results are then processed while N+1 runs. With
overlap off, each step is scheduled, run and processed in turn. A multi-rank instance keeps one step in
flight per later pipeline stage.
Overlap pays for short forwards (decode steps), whose scheduling would otherwise be a large part
of the step. A batch with a prompt chunk runs inline even with overlap on: the ~1 ms of scheduling
it could hide is small against a chunk's forward, and on CPU the runner thread made that forward
slower (GIL hand-offs, and the thread's malloc arena giving activations back to the kernel: ~900
page faults per 1k-token prefill on the runner thread vs ~70 inline).

While requests wait on KV transfers (P/D roles) the loop sleeps on its inbox and an eventfd that
the transfer layer signals on every status move, so it reacts at once; it still polls every
`transfer_poll_ms` (tuning.py) for what no status move announces (pages freed by finished requests).

A test hook (`DISAGG_FAULT_STALL_DECODE`, `env.py`): while `stall_file` exists the loop takes no step and reads
no message, but goes on reporting, so the instance's /health still answers 200: a decode stuck in its engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import zmq

from disagg_worker.engine.batch import ScheduledBatch
from disagg_worker.engine.engine import Engine
from disagg_worker.request import messages as msg
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)

LOOP = TUNING.engine
STALL_POLL_S = 0.05  # the fault hook's check for its file while it stalls the loop


class Steppable(Protocol):
    """What the stepper drives (the engine): the step's parts, in the order it calls them."""

    def tick(self) -> None: ...
    def needs_sync(self) -> bool: ...
    def schedule(self) -> ScheduledBatch | None: ...
    def depth(self, batch: ScheduledBatch | None) -> int: ...
    def launch(self, batch: ScheduledBatch | None) -> object | None: ...
    def finish(self, batch: ScheduledBatch | None, launched: object) -> None: ...

    @property
    def has_batch_work(self) -> bool: ...

    @property
    def idle(self) -> bool: ...

    @property
    def computing(self) -> bool: ...


class Stepper:
    """Steps the engine through a pipeline of launched steps, as deep as its executor allows for each batch
    (`engine.executor`: one step in flight for a decode step with overlap, none for a step with prompt chunks or
    without overlap, one per later pipeline stage across ranks). The scheduling logic lives in the Scheduler."""

    def __init__(self, engine: Steppable, after_tick: Callable[[], None] = lambda: None):
        """`after_tick` runs between the engine's tick and the next forward: tokens the tick
        produced (decode's first token, landed by a KV transfer) go out without waiting a step."""
        self.engine = engine
        self.after_tick = after_tick
        self.inflight: deque[tuple[ScheduledBatch | None, object]] = deque()

    @property
    def busy(self) -> bool:
        return bool(self.inflight) or not self.engine.idle

    @property
    def computing(self) -> bool:
        """A step is in flight or must run now."""
        return bool(self.inflight) or self.engine.has_batch_work or self.engine.computing

    def step(self) -> None:
        """One turn: schedule the next batch, launch it, and finish the steps before it down to its depth (a
        step in flight is processed while the next one computes)."""
        engine = self.engine
        engine.tick()
        self.after_tick()
        if self.inflight and engine.needs_sync():
            self.drain()
        batch = engine.schedule()
        depth = engine.depth(batch)
        self._finish_down_to(depth)  # a step that runs here, or without a batch, waits for those before it
        launched = engine.launch(batch)
        if launched is not None:
            self.inflight.append((batch, launched))
            self._finish_down_to(depth)

    def _finish_down_to(self, depth: int) -> None:
        while len(self.inflight) > depth:
            batch, launched = self.inflight.popleft()
            self.engine.finish(batch, launched)

    def drain(self) -> None:
        """Wait for every step in flight and process its results."""
        self._finish_down_to(0)

    def close(self) -> None:
        self.drain()


class EngineLoop:
    def __init__(self, engine: Engine, recv_addr: str, send_addr: str, stall_file: str = ""):
        """`stall_file`: tests only, the loop takes no step while it exists ("": never)."""
        self.engine = engine
        self.stall_file = stall_file
        self.ctx = zmq.Context()
        self.stepper = Stepper(engine, after_tick=self._send_outputs)
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
            if self.stall_file and os.path.exists(self.stall_file):
                time.sleep(STALL_POLL_S)
                self._flush()  # its reports go on: the heartbeat that keeps /health at 200
                continue
            news = self._drain_inbox(self._wait_ms())
            if news and not self.stepper.computing:
                # DP attention: the other groups may sleep until their next report, and this one is about to wait
                # for them in its next step whatever the message was (a request, or an abort that makes no work).
                self.engine.nudge()
            self.stepper.step()
            self._flush()

    def _wait_ms(self) -> int:
        if self.stepper.computing:
            return 0
        if self.engine.waiting_on_transfers:
            return LOOP.transfer_poll_ms
        return int(LOOP.stats_interval_s * 1000)

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
        self.ctx.term()
        os.close(self.wake_fd)
