"""Entry point of the scheduler process (started by the HTTP server with multiprocessing spawn)."""

from __future__ import annotations

import logging
import signal

from disagg_worker.config import EngineConfig


def run_scheduler(cfg: EngineConfig, recv_addr: str, send_addr: str, log_level: str = "info") -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(message)s")
    # The parent decides when this process ends: a SIGTERM or SIGINT sent to the whole process group
    # (systemd, a terminal) must not end it while the parent drains. The parent stops it with SIGUSR1.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    from disagg_worker.engine.engine import Engine
    from disagg_worker.engine.loop import EngineLoop

    if cfg.resolved_torch_threads:
        torch.set_num_threads(cfg.resolved_torch_threads)

    engine = Engine.from_config(cfg)
    loop = EngineLoop(engine, recv_addr, send_addr, overlap=cfg.scheduler.enable_overlap)
    signal.signal(signal.SIGUSR1, lambda *_: setattr(loop, "stopped", True))
    try:
        loop.serve_forever()
    finally:
        loop.close()
        engine.close()
