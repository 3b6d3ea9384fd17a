"""A rank of a multi-rank instance that does not schedule: it runs what the driver sends.

It holds its slice of the model (its heads, its stage's layers), its KV pool and, in a P/D role,
its own KV transfer manager, whose handles it drives by the driver's commands and the stages'
consensus (ranks/group.py). It has no scheduler, no prefix cache and no HTTP side. Its parts are
built by the same functions as the driver's (`engine.assemble`).
"""

from __future__ import annotations

import logging

from disagg_worker.config import EngineConfig
from disagg_worker.engine.assemble import build_rank, load_rank, rank_work
from disagg_worker.ranks.dist import Comm
from disagg_worker.ranks.group import follow

log = logging.getLogger(__name__)


def run_follower(cfg: EngineConfig, comm: Comm, drain_local_failures: bool = True) -> None:
    """Load this rank's slice and run the driver's steps until it says stop."""
    model, model_cfg, _, cfg = load_rank(cfg, comm, drafts=False)
    shard = comm.shard
    rank = build_rank(cfg, None if cfg.forward == "noop" else model, model_cfg, shard)
    work, _ = rank_work(cfg, comm, rank, driver=False, drain_local_failures=drain_local_failures)
    log.info("rank tp %d pp %d of %dx%d ready", shard.tp_rank, shard.pp_rank, shard.tp_size, shard.pp_size)
    try:
        follow(comm, work)
    finally:
        if rank.manager is not None:
            rank.manager.close()
