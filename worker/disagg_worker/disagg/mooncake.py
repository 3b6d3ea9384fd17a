"""Thin wrapper of the Mooncake transfer engine: asynchronous writes only.

Writes are submitted one task per batch (`transfer_submit_write`) and polled with
`transfer_check_status`, which is non-blocking and exact for a one-task batch (for a
multi-task batch it only reflects the first task). The sync calls busy-wait a core and are
not used. A submitted write cannot be cancelled: a timed-out write may still land later.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum


class WriteState(Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the wheel links libibverbs but does not ship it
        raise ImportError(
            "mooncake transfer engine unavailable (pip install mooncake-transfer-engine-non-cuda; "
            f"apt-get install libibverbs1): {e}"
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


@dataclass
class WriteGroup:
    """The writes of one send call, polled oldest first (they finish roughly in order)."""

    handles: list[int]
    nbytes: int
    started: float = field(default_factory=time.monotonic)
    _next: int = 0
    failed: bool = False

    def poll(self, engine: MooncakeEngine) -> WriteState:
        """DONE when every write landed; FAILED as soon as one failed (others may still be
        running: keep polling until `settled` to know the group is quiet)."""
        while self._next < len(self.handles):
            state = engine.check(self.handles[self._next])
            if state is WriteState.PENDING:
                return WriteState.FAILED if self.failed else WriteState.PENDING
            self.failed |= state is WriteState.FAILED
            self._next += 1
        return WriteState.FAILED if self.failed else WriteState.DONE

    @property
    def settled(self) -> bool:
        return self._next >= len(self.handles)
