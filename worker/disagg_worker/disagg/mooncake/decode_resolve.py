"""How a decode rank learns of a prefill instance (`decode` drives it, once per bootstrap address): the
instance's topology from its bootstrap server, checked against this rank and mapped onto it (`mapping`: which
prefill ranks, heads and layers feed this rank; a mismatch is named with both values), and the `DecodeHello` this
rank then sends each of those target ranks: where its KV buffers, aux slots and staging area lie.
"""

from __future__ import annotations

import threading
import time

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout, RankInfo
from disagg_worker.disagg.bootstrap_client import BootstrapError, fetch_topology
from disagg_worker.disagg.mapping import Target, check_compatible
from disagg_worker.disagg.messages import DecodeHello
from disagg_worker.disagg.mooncake.staging import StagingArea
from disagg_worker.tuning import TUNING


def resolve(
    addr: str, cfg: DisaggConfig, layout: KVLayout, rank: RankInfo, stop: threading.Event
) -> tuple[str, list[Target], str]:
    """(instance id, the prefill ranks this decode rank pulls from, "") for the prefill instance at `addr`, or
    ("", [], why not). Its bootstrap server is asked again while it is not up or the instance is incomplete, for
    up to the waiting timeout or until `stop` is set; a refusal, a topology this process cannot read or a
    mismatch ends it at once."""
    deadline = time.monotonic() + cfg.waiting_timeout_s
    error = f"prefill bootstrap server {addr} not ready within {cfg.waiting_timeout_s:g}s"
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            topo = fetch_topology(addr, cfg.bootstrap_token)
        except BootstrapError as e:
            return "", [], str(e)
        except (OSError, ValueError, KeyError):
            topo = None
        if topo is not None:
            targets, error = check_compatible(topo, cfg, layout, rank.tp_rank, rank.pp_rank)
            return ("", [], error) if error else (topo.instance_id, targets, "")
        time.sleep(TUNING.transfer.resolve_retry_s)
    return "", [], error


def decode_hello(
    decode_id: str, reply_endpoint: str, session_id: str, layout: KVLayout, staging: StagingArea
) -> DecodeHello:
    """What this rank tells each prefill rank it pulls from: which decode incarnation it is, where prefill's
    updates go, and where the pages, aux slots and staging area that prefill writes lie."""
    return DecodeHello(
        decode_id=decode_id,
        reply_endpoint=reply_endpoint,
        session_id=session_id,
        buffer_ptrs=layout.buffer_ptrs,
        buffer_nbytes=layout.buffer_nbytes,
        page_nbytes=layout.page_nbytes,
        start_layer=layout.start_layer,
        aux_item_nbytes=layout.aux_item_nbytes,
        staging_ptr=staging.ptr,
        staging_nbytes=staging.nbytes,
        num_kv_heads=layout.num_kv_heads,
        head_nbytes=layout.head_nbytes,
        kv_kind=layout.kind.value,
        draft_kv=layout.draft_kv,
    )
