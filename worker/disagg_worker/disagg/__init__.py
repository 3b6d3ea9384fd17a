"""KV transfer between prefill and decode instances (P/D disaggregation).

Request path through this package: prefill creates a KVSender per request -> decode creates
a KVReceiver, asks the prefill instance's bootstrap server where the rank lives, and sends it
the destination pages over zmq -> prefill writes its pages straight into the decode KV pool
through the transfer engine after each prefill chunk -> prefill reports Success (with the aux
record) -> decode polls Success and starts decoding.
"""

from disagg_worker.disagg.base import (
    KVLayout,
    KVManager,
    KVReceiver,
    KVSender,
    RankInfo,
    TransferFailure,
    pack_first_token,
    unpack_first_token,
)
from disagg_worker.disagg.metrics import TransferMetrics
from disagg_worker.disagg.poll import KVPoll
from disagg_worker.disagg.registry import create_kv_manager, get_backend, register_backend
from disagg_worker.disagg.runs import group_runs

__all__ = [
    "KVLayout",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "RankInfo",
    "TransferFailure",
    "TransferMetrics",
    "create_kv_manager",
    "get_backend",
    "group_runs",
    "pack_first_token",
    "register_backend",
    "unpack_first_token",
]
