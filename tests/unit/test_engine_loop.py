"""The scheduler loop: a transfer's wake-up ends its wait at once (without one the wait runs its
course), and what a transfer finished is sent before the next forward."""

from __future__ import annotations

import threading
import time

import zmq

from disagg_worker.instance.loop import EngineLoop
from tests.timing import scaled


class _Engine:
    """What EngineLoop needs to start and wait: the wake-up hook, taken from the P/D engines."""

    def set_wakeup(self, wake):
        self.wake = wake


def _loop(engine: _Engine | None = None) -> EngineLoop:
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    loop = EngineLoop(engine or _Engine(), "tcp://127.0.0.1:0", f"tcp://127.0.0.1:{port}")
    loop._sink = sink
    return loop


def _timed_wait(loop: EngineLoop, timeout_ms: int) -> float:
    t0 = time.monotonic()
    loop._drain_inbox(timeout_ms)
    return time.monotonic() - t0


def test_a_wake_up_from_another_thread_ends_the_wait():
    loop = _loop()
    try:
        threading.Timer(0.05, loop.engine.wake).start()
        assert _timed_wait(loop, 5000) < scaled(2.0)  # woken after ~50 ms, not at the 5 s timeout
        assert _timed_wait(loop, 100) >= 0.09  # the wake-up was consumed: the next wait runs its course
        for _ in range(3):  # wake-ups while the loop was busy: one wait returns at once, then none
            loop.engine.wake()
        assert _timed_wait(loop, 5000) < scaled(2.0)
        assert _timed_wait(loop, 100) >= 0.09
    finally:
        loop._sink.close(0)
        loop.close()


class _Stepping(_Engine):
    """An engine whose tick finishes a request (as a landed KV transfer does on decode) and whose
    scheduler then runs one forward; everything that happens is logged in order."""

    def __init__(self):
        self.log: list[str] = []
        self.pending: list[str] = []

    def tick(self):
        self.log.append("tick")
        self.pending.append("first token")

    def take_outputs(self):
        outs, self.pending = self.pending, []
        return outs

    def schedule(self):
        return "batch"

    def needs_sync(self):
        return True

    def depth(self, batch):
        return 0  # each step run when launched, as without overlap

    def launch(self, batch):
        self.log.append("forward")
        return "result"

    def finish(self, batch, launched):
        self.pending.append("next token")


def test_tokens_from_the_tick_are_sent_before_the_next_forward():
    loop = _loop(_Stepping())
    try:
        loop.publish = lambda m: loop.engine.log.append(f"sent {m.outputs}")
        loop.stepper.step()
        loop._send_outputs()  # what the loop does after each step
        assert loop.engine.log == ["tick", "sent ['first token']", "forward", "sent ['next token']"]
    finally:
        loop._sink.close(0)
        loop.close()
