"""A rank of a multi-rank instance that does not schedule: it runs what the driver sends.

It holds its slice of the model (its heads, its stage's layers), its KV pool and, in a P/D role,
its own KV transfer manager, whose handles it drives by the driver's commands and the stages'
consensus (ranks/group.py). It has no scheduler, no prefix cache and no HTTP side.
"""

from __future__ import annotations

import logging

import torch

from disagg_worker.config import EngineConfig
from disagg_worker.engine.assemble import build_kv_manager
from disagg_worker.engine.memory import return_freed_memory
from disagg_worker.engine.pools import DTYPES, build_kv_pool, size_pool
from disagg_worker.engine.runner import ModelRunner
from disagg_worker.model.loader import load_model
from disagg_worker.ranks.dist import Comm
from disagg_worker.ranks.group import StageWork, follow
from disagg_worker.ranks.kv import RankTransfer

log = logging.getLogger(__name__)


def run_follower(cfg: EngineConfig, comm: Comm, drain_local_failures: bool = True) -> None:
    """Load this rank's slice and run the driver's steps until it says stop."""
    torch.manual_seed(cfg.seed)
    shard = comm.shard
    model, model_cfg = load_model(
        cfg.model_path, DTYPES[cfg.dtype], cfg.device, shard, comm.collectives(), cfg.quantization
    )
    return_freed_memory()
    cfg = size_pool(cfg, model_cfg, shard, comm=comm)
    kv_pool = build_kv_pool(cfg, model_cfg, shard)
    runner = ModelRunner(None if cfg.forward == "noop" else model, kv_pool, model_cfg.vocab_size, cfg.device)
    manager = build_kv_manager(cfg, kv_pool, shard, model_cfg)
    runner.layer_stream = manager.layer_stream if manager is not None else None
    faulty = cfg.disagg.fault_fail_senders_on_stage == shard.pp_rank
    transfer = RankTransfer(manager, fail_new_senders=faulty) if manager is not None else None
    work = StageWork(comm, runner.forward, transfer, driver=False, drain_local_failures=drain_local_failures)
    log.info("rank tp %d pp %d of %dx%d ready", shard.tp_rank, shard.pp_rank, shard.tp_size, shard.pp_size)
    try:
        follow(comm, work)
    finally:
        if manager is not None:
            manager.close()
