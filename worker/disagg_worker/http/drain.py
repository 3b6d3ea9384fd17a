"""Graceful drain on SIGTERM, for a worker's HTTP front end and for the router.

On the first SIGTERM (or SIGINT) readiness fails at once (/health answers 503 "draining"), new
generation requests get 503 with Retry-After, and everything already admitted may finish: a
prefill instance's requests through their KV hand-off, a decode instance's streams to [DONE], the
router's open streams. If the drain timeout passes first, `cut` ends what is still held with an
error that says so. A second signal cuts the drain short. The caller then stops the process.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from disagg_worker.http.admission import Admission

log = logging.getLogger(__name__)

# After a cut, time for the handlers to send their error and return.
CUT_GRACE_S = 5.0


@dataclass(frozen=True)
class DrainReport:
    seconds: float
    held: int  # requests in flight when the drain began
    cut: int  # of those, ended by the drain timeout

    def describe(self) -> str:
        return (
            f"drained in {self.seconds:.1f} s: {self.held - self.cut} of {self.held} requests in flight finished, "
            f"{self.cut} cut short"
        )


def cut_message(timeout_s: float, hurried: bool) -> str:
    why = "a second shutdown signal ended its drain" if hurried else f"its drain timeout of {timeout_s:g} s expired"
    return f"The server shut down before this request finished ({why}); retry the request."


async def drain(
    admission: Admission, timeout_s: float, cut: Callable[[str], Awaitable[None]], hurry: asyncio.Event | None = None
) -> DrainReport:
    """Stop admitting, wait up to `timeout_s` for what is held, then `cut` whatever is left."""
    start = time.monotonic()
    held = admission.start_drain()
    log.info("draining: %d requests in flight, up to %g s", held, timeout_s)
    cut_short = 0
    if not await admission.wait_idle(timeout_s, hurry):
        cut_short = admission.inflight
        log.warning("drain timeout: cutting %d requests short", cut_short)
        await cut(cut_message(timeout_s, hurry is not None and hurry.is_set()))
        await admission.wait_idle(CUT_GRACE_S)
    report = DrainReport(time.monotonic() - start, held, cut_short)
    log.info("%s", report.describe())
    return report


class Signals:
    """SIGTERM/SIGINT: the first sets `stop` (begin the drain), the second `hurry` (cut it short)."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._received, sig)

    def _received(self, sig: int) -> None:
        if self.stop.is_set():
            log.warning("%s during the drain: cutting it short", signal.Signals(sig).name)
            self.hurry.set()
        else:
            log.info("%s: draining", signal.Signals(sig).name)
            self.stop.set()
