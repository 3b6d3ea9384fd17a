"""The role stage of a monolithic engine: no KV transfer, every request straight to the scheduler.

A P/D role's stage (`engine/prefill.py`, `engine/decode.py`) owns the requests that wait on KV transfers;
a monolithic engine computes every prompt and answer itself, so its stage holds nothing and waits on nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg_worker.engine.batch import ScheduledBatch, StepOutcome
from disagg_worker.engine.request import Req
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.request.messages import BootstrapInfo


class MonolithicStage:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def arrive(self, req: Req, bootstrap: BootstrapInfo | None) -> None:
        self.scheduler.add(req)

    def abort(self, rid: str) -> bool:
        return False  # whatever this engine holds, its scheduler holds

    def tick(self) -> None:
        return None

    def before_forward(self, batch: ScheduledBatch) -> None:
        return None

    def on_step(self, outcome: StepOutcome) -> None:
        return None

    waiting_on_transfers = False

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        return None

    def queue_sizes(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        return None
