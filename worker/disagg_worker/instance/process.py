"""Entry points of the scheduler processes (started by the HTTP server with multiprocessing spawn).

A single-rank instance runs one: `run_scheduler`. A multi-rank instance runs one per rank
(`run_rank`): rank 0 is the driver, which talks to the HTTP process and schedules for every rank;
the others follow it (instance/follower.py).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from disagg_worker.config import EngineConfig
from disagg_worker.model.parallel import Shard
from disagg_worker.ranks.address import RankAddress

_PR_SET_PDEATHSIG = 1  # prctl(2)

if TYPE_CHECKING:
    from disagg_worker.engine.engine import Engine
    from disagg_worker.ranks.dist import Comm


def spawn_schedulers(cfg: EngineConfig, recv_addr: str, send_addr: str, log_level: str) -> list[BaseProcess]:
    """Start this pod's scheduler processes (one per rank it runs); on pod 0 the first is the driver."""
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    if cfg.world_size == 1:
        one = (cfg, recv_addr, send_addr, log_level)
        procs.append(ctx.Process(target=run_scheduler, args=one, name="disagg-scheduler", daemon=True))
    else:
        d = cfg.disagg
        address = RankAddress.parse(d.dist_init_addr) if d.nnodes > 1 else RankAddress("127.0.0.1", _free_port())
        tp, pp, ep, dp = d.tp_size, d.pp_size, d.ep_size, d.dp_size
        for r in d.local_ranks:  # this pod's share of the ranks (all of them on one node)
            shard = Shard(r % tp, tp, r // tp, pp, ep, dp)
            peers = [group_inbox(recv_addr, g, dp) for g in range(dp) if g != shard.dp_rank]
            args = (cfg, shard, address, group_inbox(recv_addr, shard.dp_rank, dp), send_addr, log_level, peers)
            procs.append(ctx.Process(target=run_rank, args=args, name=f"disagg-rank-{r}", daemon=True))
    for proc in procs:
        proc.start()
    return procs


def group_inbox(recv_addr: str, dp_rank: int, dp_size: int) -> str:
    """The inbox of attention group `dp_rank`'s driver (DP attention: one scheduler per group)."""
    return recv_addr if dp_size == 1 else f"{recv_addr}-dp{dp_rank}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scheduler(cfg: EngineConfig, recv_addr: str, send_addr: str, log_level: str = "info") -> None:
    """The one scheduler process of a single-rank instance."""
    _start_process(cfg, log_level, "scheduler")
    _serve(build_engine(cfg), recv_addr, send_addr)


def run_rank(
    cfg: EngineConfig,
    shard: Shard,
    address: RankAddress,
    recv_addr: str,
    send_addr: str,
    log_level: str = "info",
    peers: list[str] | None = None,
) -> None:
    """One rank of a multi-rank instance: the driver serves the HTTP process, the others follow. With DP
    attention each attention group has a driver (its first rank), with its own inbox; `peers` are the other
    groups' inboxes, which it wakes before it steps (ranks.group: the groups step together).

    A follower keeps SIGUSR1's default action (it ends the process): the HTTP process stops every rank with it.
    """
    from disagg_worker.ranks.dist import Comm

    cfg = rank_config(cfg, shard)
    _start_process(cfg, log_level, f"rank tp{shard.tp_rank} pp{shard.pp_rank}", shard.world_rank)
    if cfg.device.startswith("cuda"):
        import torch

        torch.cuda.set_device(cfg.device)  # NCCL's communicators use the current device
    comm = Comm(shard, address, cfg.device, cfg.disagg.dist_timeout_s)
    try:
        if shard.pp_rank == 0 and shard.attn_tp_rank == 0:
            _serve(build_engine(cfg, comm, peers or []), recv_addr, send_addr)
        else:
            from disagg_worker.instance.follower import run_follower

            run_follower(cfg, comm)
    finally:
        comm.close()


def rank_config(cfg: EngineConfig, shard: Shard) -> EngineConfig:
    """One rank's config: `--device cuda` puts rank i of the instance on GPU i (a pod holds one GPU per rank).

    Any other device, an explicit `cuda:N` included, is every rank's as given.
    """
    if cfg.device != "cuda":
        return cfg
    local = shard.world_rank - cfg.disagg.node_rank * cfg.disagg.ranks_per_node  # its GPU in this pod
    return dataclasses.replace(cfg, device=f"cuda:{local}")


def _start_process(cfg: EngineConfig, log_level: str, name: str, rank: int = 0) -> None:
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    # The parent decides when this process ends: a SIGTERM or SIGINT sent to the whole process group
    # (systemd, a terminal) must not end it while the parent drains. The parent stops it with SIGUSR1.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    import torch

    from disagg_worker.disagg.mooncake.environ import mooncake_environ
    from disagg_worker.engine.memory import keep_freed_memory

    keep_freed_memory()
    os.environ.update(mooncake_environ(cfg.disagg, rank))  # read by the transfer engine when it starts
    if cfg.resolved_torch_threads:
        torch.set_num_threads(cfg.resolved_torch_threads)


def _die_with_parent() -> None:
    """End with the HTTP process however it ends: killed with SIGKILL it cannot stop its schedulers, which would
    otherwise live on as orphans holding the model's memory and polling their sockets (Linux's parent-death
    signal; a parent already gone before it was set is checked after)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the signal was set
        os._exit(1)


def _serve(engine: Engine, recv_addr: str, send_addr: str) -> None:
    from disagg_worker.instance.loop import EngineLoop

    loop = EngineLoop(engine, recv_addr, send_addr, stall_file=engine.cfg.disagg.fault_stall_decode)
    signal.signal(signal.SIGUSR1, lambda *_: setattr(loop, "stopped", True))
    try:
        loop.serve_forever()
    finally:
        loop.close()
        engine.close()


def build_engine(cfg: EngineConfig, comm: Comm | None = None, peers: list[str] | None = None) -> Engine:
    """This process's engine, its model loaded (`peers`: the other attention groups' inboxes, DP attention)."""
    from disagg_worker.engine.assemble import load_engine

    return load_engine(cfg, comm, peers or [])
