"""Thin wrapper of the Mooncake transfer engine: asynchronous writes only.

Writes are submitted one task per batch (`transfer_submit_write`) and polled with
`transfer_check_status`, which is non-blocking and exact for a one-task batch (for a
multi-task batch it only reflects the first task). A batch is freed once its status has been
read as finished, so a finished handle is never polled again. The sync calls busy-wait a core
and are not used. A submitted write cannot be cancelled: a timed-out write may still land later.

Mooncake's TCP transport queues at most about a thousand writes per peer; past that it rejects
writes, and after such a burst some of the queued ones never finish. Callers therefore keep at
most `TUNING.transfer.max_writes_in_flight` writes outstanding per peer.

The engine reads its settings (TCP lanes per peer and others) from the environment when it
starts; `mooncake.environ.mooncake_environ` says which, and the scheduler process sets them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol


class WriteState(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


def _import_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the wheel links libibverbs, libnuma and libcurl but does not ship them
        raise ImportError(
            "mooncake transfer engine unavailable (pip install mooncake-transfer-engine-non-cuda; "
            f"apt-get install libibverbs1 libnuma1 libcurl4): {e}"
        ) from e
    return TransferEngine


class MooncakeEngine:
    def __init__(self, host: str, protocol: str = "tcp", device: str = ""):
        self._te = _import_engine()()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"mooncake initialize({host}, {protocol}) failed: {rc}")
        self.session_id = f"{host}:{self._te.get_rpc_port()}"

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._te.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"mooncake register_memory({nbytes} bytes) failed: {rc}")

    def submit(self, peer: str, src: int, dst: int, nbytes: int) -> int:
        """Start one write; returns a handle for `check`, or -1 if it could not start."""
        bid = self._te.transfer_submit_write(peer, src, dst, nbytes)
        return bid if bid > 0 else -1

    def check(self, handle: int) -> WriteState:
        if handle < 0:
            return WriteState.FAILED
        rc = self._te.transfer_check_status(handle)
        if rc == 0:
            return WriteState.PENDING
        return WriteState.DONE if rc == 1 else WriteState.FAILED


class WriteEngine(Protocol):
    """What a `WriteGroup` needs of an engine (`MooncakeEngine`, or a scripted one in tests)."""

    def submit(self, peer: str, src: int, dst: int, nbytes: int) -> int: ...

    def check(self, handle: int) -> WriteState: ...


@dataclass
class WriteGroup:
    """The writes of one send call, submitted a few at a time (`submit`) and polled oldest first (they
    finish roughly in order). Once one write failed, the ones not yet submitted are dropped."""

    writes: list[tuple[int, int, int]]  # (src, dst, nbytes), in order
    nbytes: int
    handles: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    _next: int = 0  # handles[:_next] are settled
    failed: bool = False

    def submit(self, engine: WriteEngine, peer: str, limit: int) -> int:
        """Submit up to `limit` more writes; returns how many were submitted."""
        todo = self.writes[len(self.handles) : len(self.handles) + max(0, limit)]
        self.handles += [engine.submit(peer, s, d, n) for s, d, n in todo]
        return len(todo)

    def drop_unsubmitted(self) -> None:
        """Submit nothing more (the room failed): the group settles once the submitted writes have."""
        self.writes = self.writes[: len(self.handles)]

    def poll(self, engine: WriteEngine) -> WriteState:
        """DONE when every write landed; FAILED as soon as one failed (others may still be
        running: keep polling until `settled` to know the group is quiet)."""
        while self._next < len(self.handles):
            state = engine.check(self.handles[self._next])
            if state is WriteState.PENDING:
                break
            self.failed |= state is WriteState.FAILED
            self._next += 1
        if self.failed:
            self.drop_unsubmitted()
            return WriteState.FAILED
        return WriteState.DONE if self.settled else WriteState.PENDING

    @property
    def all_submitted(self) -> bool:
        return len(self.handles) == len(self.writes)

    @property
    def in_flight(self) -> int:
        """Writes submitted and not yet seen settled."""
        return len(self.handles) - self._next

    @property
    def settled(self) -> bool:
        """Every write submitted (or dropped) has finished or failed."""
        return self._next >= len(self.handles) and self.all_submitted
