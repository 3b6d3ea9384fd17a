"""What a prefill rank knows about a decode rank after its hello: where to write.

Mooncake writes to raw addresses in a peer's registered memory, named by its transfer session:
a `DecodePeer` holds decode's buffer addresses, which local buffer feeds which of them, the
geometry of decode's pages (its KV heads) and of its staging area (`staging`, `slices`).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.mapping import draft_mismatch, layer_buffer_map
from disagg_worker.disagg.messages import DecodeHello, RoomRequest


@dataclass(frozen=True)
class DecodePeer:
    session_id: str
    buffer_ptrs: list[int]
    buffer_nbytes: list[int]
    page_nbytes: int
    aux_item_nbytes: int
    # buffer_map[i]: index of the decode buffer that receives local buffer i.
    buffer_map: list[int]
    error: str = ""  # set when this peer cannot be served; every room from it fails with it
    staging_ptr: int = 0
    staging_nbytes: int = 0
    num_kv_heads: int = 0  # per token of a decode page; 0: not stated (whole pages only)
    head_nbytes: int = 0

    @classmethod
    def from_hello(cls, hello: DecodeHello, local: KVLayout) -> DecodePeer:
        error = draft_mismatch(local.draft_kv, hello.draft_kv)
        if error:
            pass  # the layers differ too: this says why
        elif hello.kv_kind != local.kind.value:
            theirs = _KINDS.get(hello.kv_kind, hello.kv_kind)
            error = f"KV layouts differ: prefill holds {_KINDS[local.kind.value]}, decode {theirs}"
        elif hello.head_nbytes and hello.head_nbytes != local.head_nbytes:
            error = (
                f"KV head bytes differ: prefill head_nbytes={local.head_nbytes}, decode head_nbytes={hello.head_nbytes}"
            )
        elif not hello.head_nbytes and hello.page_nbytes != local.page_nbytes:
            error = _page_mismatch(local.page_nbytes, hello.page_nbytes)
        try:
            per_layer = local.kind.buffers_per_layer
            mapping = layer_buffer_map(
                local.start_layer, local.num_layers, hello.start_layer, len(hello.buffer_ptrs) // per_layer, per_layer
            )
        except ValueError as e:
            mapping, error = [], error or str(e)
        return cls(
            session_id=hello.session_id,
            buffer_ptrs=hello.buffer_ptrs,
            buffer_nbytes=hello.buffer_nbytes,
            page_nbytes=hello.page_nbytes,
            aux_item_nbytes=hello.aux_item_nbytes,
            buffer_map=mapping,
            error=error,
            staging_ptr=hello.staging_ptr,
            staging_nbytes=hello.staging_nbytes,
            num_kv_heads=hello.num_kv_heads,
            head_nbytes=hello.head_nbytes,
        )

    def whole(self, req: RoomRequest, local: KVLayout) -> bool:
        """The request moves whole pages: every head of a page on both sides."""
        return req.num_heads < 0 or req.num_heads == local.num_kv_heads == self.num_kv_heads

    def check_dest(self, req: RoomRequest, local: KVLayout) -> str:
        """ "" if every destination page lies inside every decode buffer, the head slice inside
        both sides' pages, and a staged room inside decode's staging area."""
        limit = min(self.buffer_nbytes, default=0) // max(1, self.page_nbytes)
        bad = [p for p in req.dest_pages if not 0 <= p < limit]
        if bad:
            return f"destination pages outside decode's pool of {limit} pages: {bad[:5]}"
        if self.whole(req, local):
            slice_page = self.page_nbytes
            if self.page_nbytes != local.page_nbytes:
                return _page_mismatch(local.page_nbytes, self.page_nbytes)
        else:
            slice_page = local.page_size * max(0, req.num_heads) * local.head_nbytes
            if bad_slice := self._check_slice(req, local):
                return bad_slice
        staged = len(req.dest_pages) * slice_page * len(self.buffer_ptrs)
        if req.staging_offset >= 0 and req.staging_offset + staged > self.staging_nbytes:
            return (
                f"staged room [{req.staging_offset}, +{staged}) outside decode's staging area "
                f"of {self.staging_nbytes} bytes"
            )
        if req.decode_ranks < 1:
            return f"decode_ranks={req.decode_ranks}: at least one decode rank sends a request"
        if req.skip_pages < 0:
            return f"skip_pages={req.skip_pages}: negative"
        return "" if req.aux_slot >= 0 else f"negative aux slot {req.aux_slot}"

    def _check_slice(self, req: RoomRequest, local: KVLayout) -> str:
        if not self.num_kv_heads:
            return "decode did not state its KV heads: only whole pages can be written to it"
        src, dst, n = req.src_head, req.dst_head, req.num_heads
        if min(src, dst) < 0 or src + n > local.num_kv_heads or dst + n > self.num_kv_heads:
            return (
                f"head slice of {n} heads from {src} to {dst} outside prefill's {local.num_kv_heads} "
                f"or decode's {self.num_kv_heads} KV heads"
            )
        return ""

    def staged_dst(self, staging_offset: int, n_dest: int, local_buffer: int, dest_index: int) -> int:
        """Address in decode's staging area of destination index `dest_index` of a local buffer."""
        b = self.buffer_map[local_buffer]
        return self.staging_ptr + staging_offset + (b * n_dest + dest_index) * self.page_nbytes


_KINDS = {"mha": "per-head K and V (MHA/GQA)", "mla": "an MLA latent"}


def _page_mismatch(local: int, decode: int) -> str:
    return f"KV page bytes differ: prefill page_nbytes={local}, decode page_nbytes={decode}"
