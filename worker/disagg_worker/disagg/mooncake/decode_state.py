"""What the decode side of the `mooncake` backend keeps per prefill instance and per room
(`decode.py` drives them)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum

from disagg_worker.disagg.mapping import Target
from disagg_worker.disagg.messages import DecodeHello
from disagg_worker.disagg.mooncake.slices import StagedRange
from disagg_worker.disagg.poll import StatusCell


class InstanceState(Enum):
    RESOLVING = "resolving"
    READY = "ready"


@dataclass
class DecodeInstance:
    """One prefill instance (bootstrap address) as this decode rank sees it."""

    addr: str
    state: InstanceState = InstanceState.RESOLVING
    instance_id: str = ""
    targets: list[Target] = field(default_factory=list)
    rooms: set[int] = field(default_factory=set)
    hello: DecodeHello | None = None


@dataclass
class DecodeRoom:
    """One room on the decode side: where its KV goes and what each prefill rank said about it."""

    room: int
    addr: str
    cell: StatusCell = field(default_factory=StatusCell)
    dest_pages: list[int] = field(default_factory=list)
    aux_slot: int = -1
    skip_pages: int = 0  # leading prompt pages decode already holds: prefill sends none of them
    init_at: float = 0.0  # when init() gave the destination; 0: not yet
    asked_at: float = 0.0  # when the destination went to prefill: the waiting timeout counts from here
    targets: list[tuple[int, int]] = field(default_factory=list)  # (tp, pp) of prefill ranks asked
    done: set[tuple[int, int]] = field(default_factory=set)
    quiesced: set[tuple[int, int]] = field(default_factory=set)
    unsafe: bool = False
    failed_at: float = 0.0  # when it failed (its quarantine's age)
    staged: list[StagedRange] = field(default_factory=list)  # staging ranges prefill writes this room into
    lock: threading.Lock = field(default_factory=threading.Lock)  # Success (with its scatter) vs Failed

    @property
    def inited(self) -> bool:
        return self.init_at > 0
