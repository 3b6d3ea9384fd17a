"""Which prefill ranks feed a decode rank, and which layer buffers map onto which.

Backend-neutral rules, checked when decode first resolves a prefill instance (before any
request is sent to it) so that a mismatch fails its rooms with a message naming both values.
"""

from __future__ import annotations

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.bootstrap_client import Topology


def check_compatible(
    topo: Topology, cfg: DisaggConfig, layout: KVLayout, tp_rank: int, pp_rank: int
) -> tuple[list[RankRegistration], str]:
    """The prefill ranks this decode rank pulls from, or ([], reason) naming both values."""
    if topo.page_size != layout.page_size:
        return [], f"page size mismatch: prefill page_size={topo.page_size}, decode page_size={layout.page_size}"
    if topo.kv_dtype != layout.kv_dtype:
        return [], f"KV dtype mismatch: prefill kv_dtype={topo.kv_dtype}, decode kv_dtype={layout.kv_dtype}"
    if topo.tp_size != cfg.tp_size:
        return (
            [],
            f"unsupported TP mapping: prefill tp_size={topo.tp_size}, decode tp_size={cfg.tp_size} (must be equal)",
        )
    if cfg.pp_size == topo.pp_size:
        return [topo.rank(tp_rank, pp_rank)], ""
    if cfg.pp_size == 1:
        return [topo.rank(tp_rank, pp) for pp in range(topo.pp_size)], ""
    return (
        [],
        f"unsupported PP mapping: prefill pp_size={topo.pp_size}, decode pp_size={cfg.pp_size} (must be equal or 1)",
    )


def layer_buffer_map(src_start: int, src_layers: int, dst_start: int, dst_layers: int) -> list[int]:
    """Map buffers `[K_0..K_{n-1}, V_0..V_{n-1}]` of a rank holding layers
    `[src_start, src_start + src_layers)` onto the same layers of a rank holding
    `[dst_start, dst_start + dst_layers)`. Raises ValueError if a layer has no destination."""
    if src_start < dst_start or src_start + src_layers > dst_start + dst_layers:
        raise ValueError(
            f"prefill layers [{src_start}, {src_start + src_layers}) not held by decode layers "
            f"[{dst_start}, {dst_start + dst_layers})"
        )
    offset = src_start - dst_start
    keys = [offset + i for i in range(src_layers)]
    return keys + [dst_layers + k for k in keys]
