"""What a prefill rank knows about a decode rank after its hello: where to write.

Mooncake writes to raw addresses in a peer's registered memory, named by its transfer session:
a `DecodePeer` holds decode's buffer addresses, which local buffer feeds which of them, and the
geometry of decode's staging area (`staging`).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.mapping import layer_buffer_map
from disagg_worker.disagg.messages import DecodeHello


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

    @classmethod
    def from_hello(cls, hello: DecodeHello, local: KVLayout) -> DecodePeer:
        error = ""
        if hello.page_nbytes != local.page_nbytes:
            error = (
                f"KV page bytes differ: prefill page_nbytes={local.page_nbytes}, decode page_nbytes={hello.page_nbytes}"
            )
        try:
            mapping = layer_buffer_map(
                local.start_layer, local.num_layers, hello.start_layer, len(hello.buffer_ptrs) // 2
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
        )

    def check_dest(self, dest_pages: list[int], aux_slot: int, staging_offset: int = -1) -> str:
        """ "" if every destination page lies inside every decode buffer (and a staged room
        inside decode's staging area)."""
        limit = min(self.buffer_nbytes, default=0) // max(1, self.page_nbytes)
        bad = [p for p in dest_pages if not 0 <= p < limit]
        if bad:
            return f"destination pages outside decode's pool of {limit} pages: {bad[:5]}"
        staged = len(dest_pages) * self.page_nbytes * len(self.buffer_ptrs)
        if staging_offset >= 0 and staging_offset + staged > self.staging_nbytes:
            return (
                f"staged room [{staging_offset}, +{staged}) outside decode's staging area "
                f"of {self.staging_nbytes} bytes"
            )
        return "" if aux_slot >= 0 else f"negative aux slot {aux_slot}"

    def staged_dst(self, staging_offset: int, n_dest: int, local_buffer: int, dest_index: int) -> int:
        """Address in decode's staging area of destination index `dest_index` of a local buffer."""
        b = self.buffer_map[local_buffer]
        return self.staging_ptr + staging_offset + (b * n_dest + dest_index) * self.page_nbytes
