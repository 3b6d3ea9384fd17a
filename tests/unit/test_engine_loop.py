"""The scheduler loop's wait: a transfer's wake-up ends it at once; without one it runs its course."""
from __future__ import annotations

import threading
import time

import zmq

from disagg_worker.engine.loop import EngineLoop


class _Engine:
    """What EngineLoop needs to start and wait: the wake-up hook, taken from the P/D engines."""

    def set_wakeup(self, wake):
        self.wake = wake


def _loop() -> EngineLoop:
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.PULL)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    loop = EngineLoop(_Engine(), "tcp://127.0.0.1:0", f"tcp://127.0.0.1:{port}", overlap=False)
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
        assert _timed_wait(loop, 5000) < 2.0  # woken after ~50 ms, not at the 5 s timeout
        assert _timed_wait(loop, 100) >= 0.09  # the wake-up was consumed: the next wait runs its course
        for _ in range(3):  # wake-ups while the loop was busy: one wait returns at once, then none
            loop.engine.wake()
        assert _timed_wait(loop, 5000) < 2.0
        assert _timed_wait(loop, 100) >= 0.09
    finally:
        loop._sink.close(0)
        loop.close()
