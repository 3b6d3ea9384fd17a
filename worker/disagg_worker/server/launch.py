"""Start one engine instance: the scheduler process, then the HTTP server in this process."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
from multiprocessing.process import BaseProcess

from aiohttp import web

from disagg_worker.config import Role, ServerArgs
from disagg_worker.disagg.bootstrap import BootstrapServer
from disagg_worker.engine.process import spawn_schedulers
from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.server.api import build_app
from disagg_worker.server.auth import require_keys
from disagg_worker.server.frontend import Frontend
from disagg_worker.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


class EngineServer:
    """A running instance; `start` returns once it serves, `stop` ends the scheduler process too."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.ipc_dir = tempfile.mkdtemp(prefix="disagg-")
        self.to_engine = f"ipc://{self.ipc_dir}/to-engine"
        self.from_engine = f"ipc://{self.ipc_dir}/from-engine"
        self.procs: list[BaseProcess] = []  # the scheduler processes, one per rank
        self.bootstrap: BootstrapServer | None = None
        self.runner: web.AppRunner | None = None
        self.frontend: Frontend | None = None

    async def start(self) -> None:
        a = self.args
        tokenizer = Tokenizer.from_dir(a.engine.model_path)
        metrics = ServerMetrics(instance=f"{a.host}:{a.port}")
        self.frontend = Frontend(tokenizer, self.to_engine, self.from_engine, metrics)
        self.frontend.start()
        if a.engine.disagg.role is Role.PREFILL:
            d = a.engine.disagg
            self.bootstrap = BootstrapServer(d.bootstrap_port, d.tp_size, d.pp_size, d.bootstrap_token).start()
        self.procs = spawn_schedulers(a.engine, self.to_engine, self.from_engine, a.log_level)
        await _wait_ready(self.frontend, self.procs)
        app = build_app(self.frontend, a.engine.model_name, a.health_timeout_s)
        require_keys(app, accepted_keys(a))
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, a.host, a.port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if self.frontend is not None:
            await self.frontend.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def accepted_keys(args: ServerArgs) -> tuple[str, ...]:
    """Bearer tokens this instance's HTTP port accepts: the API keys, and the router's worker token
    when the instance has the model's shared secret (prefill and decode in a deployment)."""
    worker = args.engine.disagg.worker_token
    return args.api_keys + ((worker,) if worker else ())


async def _wait_ready(frontend: Frontend, procs: list[BaseProcess]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_TIMEOUT_S
    while not frontend.ready.is_set():
        dead = next((p for p in procs if not p.is_alive()), None)
        if dead is not None:
            raise RuntimeError(f"scheduler process {dead.name} exited with code {dead.exitcode} during start-up")
        if loop.time() > deadline:
            raise RuntimeError("the scheduler process did not become ready in time")
        await asyncio.sleep(0.1)


async def serve_until_signalled(server: EngineServer, banner: str = "") -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    if banner:
        print(banner, flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run(args: ServerArgs) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s server %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    url = f"http://{args.host}:{args.port}"
    role = args.engine.disagg.role
    banner = (
        f"disagg {role.value} instance of {args.engine.model_name} at {url}"
        if role is not Role.MONOLITHIC
        else (
            f"disagg serving {args.engine.model_name} at {url}\n"
            f"try: curl {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{args.engine.model_name}", "prompt": "Once upon a time", "max_tokens": 16}}\''
        )
    )
    asyncio.run(serve_until_signalled(EngineServer(args), banner))
