"""The role stage of a P/D instance: what a prefill or decode instance adds to the engine.

An engine in a P/D role owns one stage beside its scheduler. The engine hands it the requests
that arrive and the aborts, calls `tick` before each schedule (poll KV transfers), `before_forward`
before a forward with prompt chunks (prefill arms its layer-wise streams) and `on_step` after each
processed forward (send the KV it computed); the loop asks `waiting_on_transfers` to
decide how long it may sleep. A monolithic engine has a stage that holds nothing (`engine/monolithic.py`);
`engine.assemble` builds the stage of a role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from disagg_worker.disagg import KVReceiver, KVSender
from disagg_worker.engine.batch import ScheduledBatch, StepOutcome
from disagg_worker.engine.request import Req
from disagg_worker.request.messages import BootstrapInfo

UNROUTED = "a {role} instance serves requests routed with bootstrap_room; send requests through the router"


class Transfers(Protocol):
    """What a role stage needs of the KV transfer: this rank's `KVManager`, or in a multi-rank
    instance the ranks' agreement (`ranks.kv.RankedKV`)."""

    on_change: Callable[[], None]

    def create_sender(self, room: int) -> KVSender: ...
    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver: ...
    def close(self) -> None: ...


class RoleStage(Protocol):
    def arrive(self, req: Req, bootstrap: BootstrapInfo | None) -> None:
        """Take a new request (refused with a 400 when it was not routed with a bootstrap room)."""

    def abort(self, rid: str) -> bool:
        """Abort `rid` if this stage holds it; False when it is not here (the scheduler may have it)."""

    def tick(self) -> None:
        """Advance the transfer queues; never blocks."""

    def before_forward(self, batch: ScheduledBatch) -> None:
        """A batch with prompt chunks is about to run (prefill arms the layer-wise streams of the pages it
        completes)."""

    def on_step(self, outcome: StepOutcome) -> None:
        """Act on what a processed forward did (prefill sends the KV it completed)."""

    @property
    def waiting_on_transfers(self) -> bool:
        """Requests wait on KV transfers: the loop polls often instead of sleeping."""

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake` is called, from any thread, when a transfer this stage waits on moves."""

    def queue_sizes(self) -> dict[str, int]: ...

    def close(self) -> None:
        """Release what the stage holds outside this process (the transfer engine)."""
