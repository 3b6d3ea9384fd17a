"""Entry point of the scheduler process (started by the HTTP server with multiprocessing spawn)."""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

from disagg_worker.config import EngineConfig

if TYPE_CHECKING:
    from disagg_worker.engine.engine import Engine


def run_scheduler(cfg: EngineConfig, recv_addr: str, send_addr: str, log_level: str = "info") -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    import torch

    from disagg_worker.disagg.mooncake.environ import mooncake_environ
    from disagg_worker.engine.loop import EngineLoop

    os.environ.update(mooncake_environ(cfg.disagg))  # read by the transfer engine when it starts
    if cfg.resolved_torch_threads:
        torch.set_num_threads(cfg.resolved_torch_threads)

    engine = build_engine(cfg)
    loop = EngineLoop(engine, recv_addr, send_addr, overlap=cfg.scheduler.enable_overlap)
    signal.signal(signal.SIGTERM, lambda *_: setattr(loop, "stopped", True))
    try:
        loop.serve_forever()
    finally:
        loop.close()
        engine.close()


def build_engine(cfg: EngineConfig) -> Engine:
    from disagg_worker.engine.engine import Engine

    return Engine.from_config(cfg)
