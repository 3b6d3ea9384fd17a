"""KV transfer between prefill and decode instances (P/D disaggregation).

Request path through this package: prefill creates a KVSender per request -> decode creates
a KVReceiver, asks the prefill instance's bootstrap server where the rank lives, and sends it
the destination pages over zmq -> prefill writes its pages straight into the decode KV pool
through the transfer engine after each prefill chunk -> prefill reports Success (with the aux
record) -> decode polls Success and starts decoding.

This level holds what any backend shares, the contract and the control plane:
- `poll`: the poll states of a room and the one place they move (`StatusCell`).
- `base`: the sender / receiver / manager interface the schedulers see, and `KVLayout`.
- `backends`: backends by config name (`BACKENDS`) and `create_kv_manager`.
- `rooms`: the table of live rooms, with tombstones so that a room is never reused.
- `messages` and `channel`: the control messages between decode and prefill ranks, their one
  codec, and the zmq channel that carries them (nothing in either knows how the bytes move).
- `bootstrap`, `bootstrap_client`: where a prefill instance's ranks are, over HTTP.
- `mapping`: which prefill ranks feed a decode rank, with which KV heads and layers (TP, PP, page
  size, KV dtype, head size), layer maps.
- `heartbeat`: decode's liveness check of prefill instances.
- `runs`: page lists grouped into contiguous runs (one write per run, whatever the backend).
- `metrics`: transfer counters and Prometheus series.
- `fake`: a backend that moves nothing (unit tests, scheduler benchmarks).
`mooncake/` is the Mooncake backend: everything that depends on how Mooncake moves bytes.

Names below are imported on first use (PEP 562): the HTTP process imports `bootstrap` without torch, which
the transfer side needs (`base` -> `mem.kv_pool`); torch alone is ~500 MB of a process's memory.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disagg_worker.disagg.backends import BACKENDS, create_kv_manager, manager_class
    from disagg_worker.disagg.base import (
        AUX_ITEM_NBYTES,
        KVLayout,
        KVManager,
        KVReceiver,
        KVSender,
        RankInfo,
        TransferFailure,
        adapter_tag,
        pack_aux,
        pack_first_token,
        unpack_adapter_tag,
        unpack_draft,
        unpack_first_token,
        unpack_top_logprobs,
    )
    from disagg_worker.disagg.metrics import TransferMetrics
    from disagg_worker.disagg.poll import KVPoll
    from disagg_worker.disagg.runs import group_runs

_HOMES = {
    **dict.fromkeys(["BACKENDS", "create_kv_manager", "manager_class"], "backends"),
    **dict.fromkeys(
        [
            "AUX_ITEM_NBYTES",
            "KVLayout",
            "KVManager",
            "KVReceiver",
            "KVSender",
            "RankInfo",
            "TransferFailure",
            "adapter_tag",
            "pack_aux",
            "pack_first_token",
            "unpack_adapter_tag",
            "unpack_draft",
            "unpack_first_token",
            "unpack_top_logprobs",
        ],
        "base",
    ),
    "TransferMetrics": "metrics",
    "KVPoll": "poll",
    "group_runs": "runs",
}


if not TYPE_CHECKING:  # mypy reads the imports above, so a misspelt name stays an error

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "BACKENDS",
    "KVLayout",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "RankInfo",
    "TransferFailure",
    "TransferMetrics",
    "create_kv_manager",
    "group_runs",
    "manager_class",
    "AUX_ITEM_NBYTES",
    "adapter_tag",
    "pack_aux",
    "pack_first_token",
    "unpack_adapter_tag",
    "unpack_draft",
    "unpack_first_token",
    "unpack_top_logprobs",
]
