"""Layer-wise KV streaming on a prefill rank: a chunk's pages leave layer group by layer group while
the forward computes the layers after them, instead of all at once after the step.

Before a forward, the prefill stage arms the senders of the rooms whose pages it completes
(`KVSender.stream`); each arms this rank's `LayerStream` with what to send. The model calls
`layer_done(i)` after each of this rank's layers (`i` counts from this rank's first layer, so each
pipeline stage streams its own); at the end of each group (`plan_groups`) every armed room queues
the writes of that group's KV buffers (`layer_buffers`). On a GPU the group's writes first wait on
an event recorded right after the group (not on the whole stream); on the CPU the forward and the
transfer threads simply run side by side. The send after the step then moves only what nothing
streamed (a draft model's layers, written after the forward) and, with the last chunk, the aux
record: a room reports Success only once every write of every group has landed, so decode counts it
transferred only when every group of every rank has arrived, the aux record last.

`StreamRound` accounts for one forward: how long the transfer of its groups took, and how much of
that the forward hid.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disagg_worker.disagg.metrics import TransferMetrics

log = logging.getLogger(__name__)


def plan_groups(num_layers: int, group_size: int) -> list[range]:
    """This rank's layers `[0, num_layers)` in consecutive groups of `group_size`, but the layers of the last group
    one by one: no compute hides the transfer of the group that ends the forward, so only the last layer's shows
    instead of a whole group's (a 4k-token chunk of 32 layers over 500 Mbit/s: 8 ms instead of 34)."""
    if group_size < 1:
        raise ValueError(f"a layer group holds at least one layer, not {group_size}")
    groups = [range(s, min(s + group_size, num_layers)) for s in range(0, num_layers, group_size)]
    return groups[:-1] + [range(i, i + 1) for i in groups[-1]] if groups else []


def layer_buffers(layers: range, num_layers: int, per_layer: int) -> list[int]:
    """The KV buffers of `layers` in a pool of `num_layers` layers ordered as `KVPool.buffers()`:
    `per_layer` blocks of one buffer per layer (K of each layer, then V; MLA's latent: one block)."""
    return [b * num_layers + layer for b in range(per_layer) for layer in layers]


def split_streamed(first: int, count: int, streamed: int) -> tuple[int, int]:
    """Of `count` pages at positions `[first, first + count)`, how many lie before `streamed` (their
    streamed layers already left) and how many after (every layer still to send)."""
    before = min(max(streamed - first, 0), count)
    return before, count - before


def unstreamed_parts(
    start: int, pages: list[int], streamed: int, rest: list[int]
) -> list[tuple[int, list[int], list[int] | None]]:
    """What a send of `pages` (room positions from `start`) still writes once a stream sent the model's
    layers of the positions before `streamed`: (offset in `pages`, pages, buffers; None: every buffer). The
    streamed pages need only the `rest` buffers (a draft model's layers); none, when `rest` is empty."""
    before, _ = split_streamed(start, len(pages), streamed)
    parts = [(0, pages[:before], rest), (before, pages[before:], None)]
    return [(offset, part, buffers) for offset, part, buffers in parts if part and buffers != []]


class StreamRound:
    """The streamed writes of one forward: when the first was queued, when the forward ended, when the
    last settled. Its hidden share is the part of the transfer's span that ran while the forward was
    still computing; it is known once the forward ended and every queued group settled."""

    def __init__(self, metrics: TransferMetrics, clock: Callable[[], float] = time.monotonic):
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self.first_queued = 0.0
        self.forward_end = 0.0
        self.last_settled = 0.0
        self.pending = 0
        self.reported = False

    def queued(self, jobs: int) -> None:
        with self._lock:
            self.first_queued = self.first_queued or self._clock()
            self.pending += jobs

    def settled(self, queued_at: float) -> None:
        """One job of the round settled (its writes all finished or failed)."""
        now = self._clock()
        self._metrics.group_sent(now - queued_at)
        with self._lock:
            self.pending -= 1
            self.last_settled = max(self.last_settled, now)
        self._report()

    def forward_ended(self) -> None:
        with self._lock:
            self.forward_end = self._clock()
        self._report()

    def hidden_share(self) -> float | None:
        """The share of the transfer hidden behind the forward (None until known)."""
        if not self.forward_end or self.pending or not self.first_queued:
            return None
        span = self.last_settled - self.first_queued
        if span <= 0:
            return 1.0
        return max(0.0, min(self.last_settled, self.forward_end) - self.first_queued) / span

    def _report(self) -> None:
        with self._lock:
            share = self.hidden_share()
            if share is None or self.reported:
                return
            self.reported = True
        self._metrics.stream_hidden(share)


# What an armed room does at the end of a group: queue that group's writes (layers, the group's CUDA event
# or None, the forward's round).
GroupSend = Callable[[range, Any, StreamRound], None]


class LayerStream:
    """One rank's streaming for the forward about to run. `arm` (before the forward, the scheduler's
    thread), `layer_done` after each layer and `forward_done` after the forward (the forward's thread),
    `disarm` when the forward raised (nothing more is sent: the rooms fail with the step). `stall`, a test hook
    (`env`, (-1, "") off): (N, PATH) makes a forward stop after queuing group N while the file PATH does not exist,
    so that a fault test interrupts a room whose first groups left and whose others did not."""

    def __init__(
        self,
        num_layers: int,
        group_size: int,
        metrics: TransferMetrics,
        cuda: bool = False,
        stall: tuple[int, str] = (-1, ""),
    ):
        self.groups = plan_groups(num_layers, group_size)
        self._stall = stall
        self._ends = {g.stop - 1: g for g in self.groups}
        self._metrics = metrics
        self._cuda = cuda
        self._lock = threading.Lock()
        self._armed: list[GroupSend] = []
        self._next = 0  # the first group not yet sent in this forward
        self._round: StreamRound | None = None

    @property
    def armed(self) -> bool:
        with self._lock:
            return bool(self._armed)

    def arm(self, send: GroupSend) -> None:
        with self._lock:
            self._armed.append(send)

    def layer_done(self, layer: int) -> None:
        """The forward computed this rank's layer `layer`: at a group's end, every armed room sends it."""
        group = self._ends.get(layer)
        if group is not None:
            index = self.groups.index(group)
            self._send_through(index + 1)
            if index == self._stall[0] and self.armed:
                self._stall_here(index, Path(self._stall[1]))

    def forward_done(self) -> None:
        """The forward ended: groups it did not announce (a forward without layer hooks) go now; disarm."""
        self._send_through(len(self.groups))
        with self._lock:
            rnd, self._round, self._armed, self._next = self._round, None, [], 0
        if rnd is not None:
            rnd.forward_ended()

    def disarm(self) -> None:
        with self._lock:
            self._armed, self._round, self._next = [], None, 0

    def _send_through(self, stop: int) -> None:
        with self._lock:
            sends, groups = list(self._armed), self.groups[self._next : stop]
            if not sends:
                return
            self._next = max(self._next, stop)
            if sends and groups and self._round is None:
                self._round = StreamRound(self._metrics)
            rnd = self._round
        if not groups or rnd is None:
            return
        event = self._record()
        for group in groups:
            for send in sends:
                send(group, event, rnd)

    @staticmethod
    def _stall_here(index: int, release: Path) -> None:
        """The test hook: the forward waits while `release` does not exist."""
        if release.exists():
            return
        log.warning("fault injected: the forward stalls after layer group %d until %s exists", index, release)
        while not release.exists():
            time.sleep(0.05)

    def _record(self) -> Any:
        """An event after the work queued so far on the current CUDA stream (None on the CPU)."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event
