"""Writes of a prefill rank: planning, the per-peer budget and staging.

Each send() becomes a `SendJob` (`prefill_sends`) for the transfer thread of its decode peer
(`TransferWorkers`), which plans its writes when it starts it. Contiguous page runs go straight from
the pool into decode's pool, one write per run per KV buffer. When decode named a staging range for
the room (its destination is fragmented), each send is gathered into the local staging area and
written as one block per KV buffer; decode scatters it before Success (`staging`). When decode wants
only some of this rank's KV heads, or holds more heads than this rank, the head slice moves as whole
slice pages through the same staging areas (`slices`). When nothing else is in flight to the peer,
large writes are split into pieces (`split_writes`), which Mooncake moves over several of its TCP
lanes at once. At most `max_writes_in_flight` writes are outstanding per peer; the rest wait in
their job.

What decode must hear is the control side's business (`prefill`): the transfer threads report
through three callbacks: a write of a job failed, a job is still on the wire after the notice
delay, a job settled (every write finished or failed).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.mooncake.engine import MooncakeEngine, WriteGroup, WriteState
from disagg_worker.disagg.mooncake.prefill_room import SendJob
from disagg_worker.disagg.mooncake.slices import PageShape, SliceSide, gather_heads, slice_writes
from disagg_worker.disagg.mooncake.staging import StagingArea, gather, worth_staging
from disagg_worker.disagg.mooncake.transfer_workers import Progress, TransferWorkers
from disagg_worker.disagg.poll import KVPoll
from disagg_worker.disagg.runs import group_runs
from disagg_worker.tuning import TUNING

Write = tuple[int, int, int]  # (src address, dst address, nbytes)
JobEvent = Callable[[SendJob], None]


def split_writes(writes: list[Write], pieces: int = 0, min_piece: int = 0) -> list[Write]:
    """Split writes so that large ones travel as about `pieces` pieces (default
    `TUNING.transfer.write_pieces`) of at least `min_piece` bytes (default
    `TUNING.transfer.min_piece_nbytes`); the pieces cover the same bytes, in order."""
    pieces = pieces or TUNING.transfer.write_pieces
    min_piece = min_piece or TUNING.transfer.min_piece_nbytes
    total = sum(n for _, _, n in writes)
    piece = max(min_piece, -(-total // pieces))
    out: list[Write] = []
    for src, dst, n in writes:
        for off in range(0, n, piece):
            out.append((src + off, dst + off, min(piece, n - off)))
    return out


class PrefillWrites:
    def __init__(
        self,
        engine: MooncakeEngine,
        layout: KVLayout,
        buffers: list[torch.Tensor],
        staging: StagingArea,
        on_failed: JobEvent,
        on_notice: JobEvent,
        on_settled: JobEvent,
    ):
        """`buffers`: byte views of the KV buffers of `layout` (to gather staged sends from)."""
        self.engine = engine
        self.layout = layout
        self.staging = staging
        self._buffers = buffers
        self._on_failed, self._on_notice, self._on_settled = on_failed, on_notice, on_settled
        self._workers: TransferWorkers[SendJob] = TransferWorkers(self._start, self._progress)
        self._in_flight: dict[str, int] = {}  # writes submitted and not yet settled, per decode session

    def put(self, job: SendJob) -> None:
        """Queue a job for the transfer thread of its peer (any thread)."""
        self._workers.put(job.peer.session_id, job)

    def busy(self, session_id: str) -> bool:
        """Whether sends to this decode session are queued or on the wire."""
        return self._workers.busy(session_id)

    def forget(self, session_id: str) -> None:
        """The peer is gone: its transfer thread exits once what it holds has settled."""
        self._workers.retire(session_id)

    @property
    def sessions(self) -> list[str]:
        """Decode sessions with a live transfer thread."""
        return self._workers.destinations

    def close(self) -> None:
        self._workers.close()

    # ---- transfer thread of the job's peer ------------------------------------------------
    def _start(self, job: SendJob) -> None:
        if job.ready is not None:  # a streamed group on a GPU: its layers' kernels are done once this is
            job.ready.synchronize()
        writes = self._plan(job) if job.room.cell.get() is not KVPoll.Failed else []
        job.group = WriteGroup(writes, sum(n for _, _, n in writes))
        self._submit(job)

    def _submit(self, job: SendJob) -> None:
        """Submit as many of the job's writes as its peer's budget allows."""
        group, peer = job.group, job.peer.session_id
        if job.room.cell.get() is KVPoll.Failed:
            group.drop_unsubmitted()
        free = self._budget(peer)
        if free > 0 and not group.settled:
            self._in_flight[peer] = self._in_flight.get(peer, 0) + group.submit(self.engine, peer, free)

    def _budget(self, peer: str) -> int:
        """Writes that may still be submitted to `peer` now."""
        return TUNING.transfer.max_writes_in_flight - self._in_flight.get(peer, 0)

    def _plan(self, job: SendJob) -> list[Write]:
        """Every write of a job. Large writes are split into pieces only when the link to the peer
        is idle: with other writes in flight Mooncake's lanes are busy already, and more pieces
        only add per-write cost."""
        idle = self._in_flight.get(job.peer.session_id, 0) == 0
        pieces = TUNING.transfer.write_pieces if idle else 1
        if not job.peer.whole(job.request, self.layout):
            return split_writes(self._sliced_writes(job), pieces)
        if job.request.staging_offset >= 0:
            return split_writes(self._staged_writes(job), pieces)
        return split_writes(self._direct_writes(job), pieces)

    def _buffers_of(self, job: SendJob) -> list[int]:
        """The local KV buffers the job writes: all, or a streamed layer group's."""
        return list(range(len(self.layout.buffer_ptrs))) if job.buffers is None else job.buffers

    def _direct_writes(self, job: SendJob) -> list[Write]:
        """One write per page run per buffer, from the pool into decode's pool."""
        peer, pn, ptrs = job.peer, self.layout.page_nbytes, self.layout.buffer_ptrs
        writes = []
        for src, dst, n in group_runs(job.src_pages, job.dst_pages):
            for i in self._buffers_of(job):
                writes.append((ptrs[i] + src * pn, peer.buffer_ptrs[peer.buffer_map[i]] + dst * pn, n * pn))
        return writes

    def _staged_writes(self, job: SendJob) -> list[Write]:
        """Writes into decode's staging area: one block per buffer gathered through the local
        staging area, or page runs straight from the pool when it is full."""
        peer, pn, req = job.peer, self.layout.page_nbytes, job.request
        n_dest, m = len(req.dest_pages), len(job.src_pages)
        block, bufs = m * pn, self._buffers_of(job)
        off = self.staging.alloc(block * len(bufs))
        if off >= 0:
            job.staged = (off, block * len(bufs))
            writes = []
            for k, i in enumerate(bufs):
                gather(self._buffers[i], pn, job.src_pages, self.staging.view(off + k * block, block))
                dst = peer.staged_dst(req.staging_offset, n_dest, i, job.first_index)
                writes.append((self.staging.ptr + off + k * block, dst, block))
            return writes
        index, ptrs = list(range(job.first_index, job.first_index + m)), self.layout.buffer_ptrs
        return [
            (ptrs[i] + src * pn, peer.staged_dst(req.staging_offset, n_dest, i, j), n * pn)
            for src, j, n in group_runs(job.src_pages, index)
            for i in bufs
        ]

    def _sliced_writes(self, job: SendJob) -> list[Write]:
        """Writes of a head slice (`slices`): a scattered or fragmented source is gathered into the
        local staging area first; a scattered destination was given a range of decode's."""
        lay, req, peer = self.layout, job.request, job.peer
        count, m = req.num_heads, len(job.src_pages)
        if count <= 0 or not m:
            return []  # a replicated head another prefill rank writes: nothing from this one
        shape = PageShape(lay.page_size, lay.num_kv_heads, lay.head_nbytes)
        token, page, bufs = count * lay.head_nbytes, shape.slice_nbytes(count), self._buffers_of(job)
        src = SliceSide(
            [lay.buffer_ptrs[i] for i in bufs],
            job.src_pages,
            lay.page_nbytes,
            lay.num_kv_heads * lay.head_nbytes,
            req.src_head * lay.head_nbytes,
        )
        if not src.contiguous(lay.page_size, token) or worth_staging(job.src_pages):
            off = self.staging.alloc(m * page * len(bufs))
            if off >= 0:
                job.staged = (off, m * page * len(bufs))
                blocks = [off + k * m * page for k in range(len(bufs))]
                for i, block in zip(bufs, blocks, strict=True):
                    view = self.staging.view(block, m * page)
                    gather_heads(self._buffers[i], shape, req.src_head, count, job.src_pages, view)
                src = SliceSide([self.staging.ptr + b for b in blocks], list(range(m)), page, token)
        dst_buffers = [peer.buffer_map[i] for i in bufs]
        if req.staging_offset >= 0:
            n_dest, base = len(req.dest_pages), peer.staging_ptr + req.staging_offset
            index = list(range(job.first_index, job.first_index + m))
            dst = SliceSide([base + b * n_dest * page for b in dst_buffers], index, page, token)
        else:
            bases = [peer.buffer_ptrs[b] for b in dst_buffers]
            dst = SliceSide(
                bases,
                job.dst_pages,
                peer.page_nbytes,
                peer.num_kv_heads * lay.head_nbytes,
                req.dst_head * lay.head_nbytes,
            )
        return slice_writes(src, dst, lay.page_size, token)

    def _progress(self, job: SendJob) -> Progress:
        """Advance one job: poll its writes, submit more, report what the control side must know."""
        group, peer = job.group, job.peer.session_id
        in_flight = group.in_flight
        polled = group.poll(self.engine)
        unchanged = polled is WriteState.PENDING and group.in_flight == in_flight
        if unchanged and (group.all_submitted or self._budget(peer) <= 0) and not job.notice_due():
            return Progress.WAITING  # the common case while writes are on the wire
        self._in_flight[peer] = self._in_flight.get(peer, 0) - (in_flight - group.in_flight)
        if polled is WriteState.FAILED:
            self._on_failed(job)
        self._submit(job)
        if group.settled and job.staged is not None:
            self.staging.free(*job.staged)
            job.staged = None
        if not group.settled:
            if job.notice_due():
                job.first = False  # informational: a short send skips it, no CPU taken from the writes
                self._on_notice(job)
            return Progress.MOVED
        self._on_settled(job)
        return Progress.SETTLED
