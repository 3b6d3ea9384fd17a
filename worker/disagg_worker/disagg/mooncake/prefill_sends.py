"""What a prefill room's sends become: one `SendJob` per decode rank of the room.

The scheduler's `send()` of a chunk's pages is checked against what decode asked for (its destination pages, the
leading pages it holds already, the size of its aux record), trimmed of the pages decode holds and of the layers a
layer-wise stream wrote already, and counted by the room (`PrefillRoom`); with layer-wise streaming, `stream()`
arms this rank's `LayerStream` before a forward, and the forward's thread queues each layer group's writes as soon
as the group is computed. Either way every decode rank of the room gets a job for its transfer thread
(`prefill_writes`). A send that breaks a rule fails the room through the control side (`prefill`), which tells
decode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from disagg_worker.disagg.base import KVLayout, check_pages
from disagg_worker.disagg.layerwise import LayerStream, StreamRound, layer_buffers, unstreamed_parts
from disagg_worker.disagg.mooncake.prefill_room import PrefillRoom, SendJob
from disagg_worker.disagg.poll import KVPoll


class PrefillSends:
    def __init__(
        self,
        layout: KVLayout,
        waiting_timeout_s: float,
        put: Callable[[SendJob], None],
        fail: Callable[[PrefillRoom, str], None],
        layer_stream: LayerStream | None,
    ):
        """`put` queues a job for its peer's transfer thread; `fail` fails a room and tells decode."""
        self.layout = layout
        self.waiting_timeout_s = waiting_timeout_s
        self.layer_stream = layer_stream
        self._put, self._fail = put, fail

    def send(self, state: PrefillRoom, pages: list[int], last: bool, aux: bytes) -> None:
        """`PrefillSender.send`: check the pages, count them, queue them for the peer's transfer thread."""
        status = state.cell.get()
        if status is KVPoll.Failed:
            return
        if status < KVPoll.WaitingForInput or not state.ready or state.last_queued:
            self._fail(
                state, f"send() in status {status.name}" + (" after the last chunk" if state.last_queued else "")
            )
            return
        problem = check_pages(pages, self.layout.num_pages)
        skip = state.dests[0][1].skip_pages  # the room's first pages, which decode holds already
        allocated = skip + len(state.dests[0][1].dest_pages)
        held = min(max(skip - state.sent, 0), len(pages))  # pages of this send that decode holds
        if state.sent + len(pages) > allocated:
            problem = f"{state.sent + len(pages)} pages sent but decode allocated {allocated}"
        elif last and pages and held == len(pages):
            problem = f"decode holds the room's last page (it skips {skip}): it must receive the last token's KV"
        aux_limit = min(peer.aux_item_nbytes for peer, _ in state.dests)
        if last and len(aux) > aux_limit:
            problem = f"aux record of {len(aux)} bytes exceeds decode's {aux_limit}"
        if problem:
            self._fail(state, problem)
            return
        lay = self.layout
        rest = layer_buffers(range(lay.model_layers, lay.num_layers), lay.num_layers, lay.kind.buffers_per_layer)
        parts = unstreamed_parts(state.sent + held, pages[held:], state.streamed, rest)
        if not parts and not last:  # all held or streamed: nothing to write (a last send always settles a job)
            state.skip_send(len(pages))
            return
        parts = parts or [(0, [], [])]  # the last send of a fully streamed room: the aux record alone
        first_index = state.queue_send(
            len(pages), last, aux, self.waiting_timeout_s, jobs=len(state.dests) * len(parts)
        )
        first_index += held - skip  # from here on, positions in dest_pages
        first = state.cell.advance(KVPoll.Transferring)
        for offset, part, buffers in parts:
            self._put_jobs(state, part, first_index + offset, last, first, buffers)

    def _put_jobs(
        self,
        state: PrefillRoom,
        pages: list[int],
        first_index: int,
        last: bool,
        first: bool,
        buffers: list[int] | None,
        ready: object = None,
        stream: StreamRound | None = None,
    ) -> None:
        """One job per decode rank of the room: `pages` at destination positions from `first_index`."""
        for peer, req in state.dests:
            dst = req.dest_pages[first_index : first_index + len(pages)]
            job = SendJob(
                room=state,
                peer=peer,
                request=req,
                src_pages=pages,
                dst_pages=dst,
                last=last,
                first=first,
                first_index=first_index,
                buffers=buffers,
                ready=ready,
                stream=stream,
            )
            self._put(job)

    def stream(self, state: PrefillRoom, pages: list[int]) -> None:
        """`PrefillSender.stream`: arm this rank's layer stream with the pages the next forward completes."""
        if self.layer_stream is None or state.cell.get() is KVPoll.Failed or not pages:
            return
        start, problem = state.check_stream(len(pages))
        if problem:
            self._fail(state, problem)
            return
        state.streamed = start + len(pages)
        held = min(max(state.skip - start, 0), len(pages))  # pages decode holds: never sent
        if held < len(pages):
            self.layer_stream.arm(functools.partial(self._send_group, state, pages[held:], start + held - state.skip))

    def _send_group(
        self, state: PrefillRoom, pages: list[int], first_index: int, layers: range, ready: object, rnd: StreamRound
    ) -> None:
        """The forward computed `layers` (the forward's thread): queue their writes of the armed pages."""
        jobs = len(state.dests)
        if not state.queue_stream(jobs, self.waiting_timeout_s):
            return  # the room failed: nothing more of it is written
        rnd.queued(jobs)
        first = state.cell.advance(KVPoll.Transferring)
        lay = self.layout
        buffers = layer_buffers(layers, lay.num_layers, lay.kind.buffers_per_layer)
        self._put_jobs(state, pages, first_index, False, first, buffers, ready, rnd)
