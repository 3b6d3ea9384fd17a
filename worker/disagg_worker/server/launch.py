"""Start one engine instance: the scheduler process, then the HTTP server in this process.

Life cycle: `start` returns once the instance serves; from then on the scheduler process is
watched (its exit fails every waiting request at once, `frontend.py`). On SIGTERM the instance
drains (`http/drain.py`: readiness fails, admitted requests finish within --drain-timeout), then `stop`
ends the scheduler process and the process exits 0.

The scheduler process ignores SIGTERM and SIGINT (a signal to the whole process group, as systemd
or a terminal sends, must not cut the drain short); it is stopped with SIGUSR1 by this process, and
stops by itself when this process is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

from aiohttp import web

from disagg_worker.config import Role, ServerArgs
from disagg_worker.disagg.bootstrap import BootstrapServer, listen_host
from disagg_worker.http.admission import CLIENT_BODY_BUDGET_BYTES, Admission
from disagg_worker.http.auth import require_keys
from disagg_worker.http.drain import CUT_GRACE_S, DrainReport, Signals, drain
from disagg_worker.instance.process import group_inbox, spawn_schedulers
from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.server.api import ADMISSION, AppPart, build_app
from disagg_worker.server.frontend import Frontend
from disagg_worker.server.metrics import ServerMetrics
from disagg_worker.server.response_store import ResponseStore
from disagg_worker.tracing import Tracer, Trust

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


class EngineServer:
    """A running instance; `start` returns once it serves, `stop` ends the scheduler process too."""

    def __init__(self, args: ServerArgs, parts: Sequence[AppPart] = ()):
        """`parts`: what joins the HTTP app from above (`api.AppPart`: a decode's hand-off for gateways)."""
        self.args = args
        self.parts = parts
        self.ipc_dir = tempfile.mkdtemp(prefix="disagg-")
        self.to_engine = f"ipc://{self.ipc_dir}/to-engine"
        self.from_engine = f"ipc://{self.ipc_dir}/from-engine"
        self.procs: list[BaseProcess] = []  # the scheduler processes, one per rank
        self.bootstrap: BootstrapServer | None = None
        self.runner: web.AppRunner | None = None
        self.frontend: Frontend | None = None
        self.admission: Admission | None = None

    async def start(self) -> None:
        a = self.args
        if a.engine.disagg.role is Role.PREFILL:
            d = a.engine.disagg
            # This instance's own ranks register with it at the address it listens on (`bootstrap.leader_url`).
            self.bootstrap = BootstrapServer(
                d.bootstrap_port,
                d.attn_tp_size,
                d.pp_size,
                d.bootstrap_token,
                host=listen_host(d.advertise_host),
                dp_size=d.dp_size,
            ).start()
        self.procs = spawn_schedulers(a.engine, self.to_engine, self.from_engine, a.log_level)
        d = a.engine.disagg
        # The tokenizer loads while the scheduler processes load the model: from a GGUF file each takes
        # seconds. zmq queues the schedulers' messages until the frontend binds its socket.
        tokenizer = await asyncio.to_thread(Tokenizer.from_path, a.engine.model_path)
        max_loras = a.engine.lora.max_loras if a.engine.lora.enabled else 0
        metrics = ServerMetrics(instance=f"{a.host}:{a.port}", role=d.role.value, max_loras=max_loras)
        inboxes = [group_inbox(self.to_engine, g, d.dp_size) for g in range(d.dp_size)]
        prefill = d.role is Role.PREFILL
        key_id = d.kv_names[1]
        tracer = Tracer.create(d.role.value, a.otlp_traces_endpoint, a.otlp_traces_sampling_ratio, trace_trust(a))
        routed = d.role is not Role.MONOLITHIC
        self.frontend = frontend = Frontend(
            tokenizer, inboxes, self.from_engine, metrics, prefill, key_id, tracer, routed=routed
        )
        frontend.start()
        await _wait_ready(frontend, self.procs)
        local = a.engine.disagg.local_prefill
        # A monolithic server keeps its Responses API answers; in P/D the router does.
        responses = ResponseStore() if d.role is Role.MONOLITHIC else None
        app = build_app(
            frontend,
            a.engine.model_name,
            a.health_timeout_s,
            a.inflight_limit,
            local_prefill=local,
            responses=responses,
            # Clients reach a monolithic server; a P/D worker's one client is the router.
            client_body_budget=CLIENT_BODY_BUDGET_BYTES if d.role is Role.MONOLITHIC else None,
            parts=self.parts,
            adapters=[name for name, _ in a.engine.lora.adapters],
        )
        require_keys(app, a.api_keys, peer_keys(a))
        self.admission = admission = app[ADMISSION]
        frontend.watch(self.procs, on_exit=lambda reason: setattr(admission, "broken", reason))
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=CUT_GRACE_S)
        await self.runner.setup()
        await web.TCPSite(self.runner, a.host, a.port).start()

    async def drain(self, hurry: asyncio.Event | None = None) -> DrainReport | None:
        """Finish what is admitted within the drain timeout (`http/drain.py`); None if the instance never served."""
        if self.admission is None or self.frontend is None:
            return None
        frontend = self.frontend

        async def cut(reason: str) -> None:
            frontend.fail_all(reason)

        return await drain(self.admission, self.args.drain_timeout_s, cut, hurry)

    async def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.unwatch()
        if self.runner is not None:
            await self.runner.cleanup()
        for proc in self.procs:  # the driver first: it stops stepping before its followers go
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGUSR1)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if self.frontend is not None:
            await self.frontend.close()
            if self.frontend.tracer is not None:
                self.frontend.tracer.shutdown()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def peer_keys(args: ServerArgs) -> tuple[str, ...]:
    """Bearer tokens this instance's HTTP port accepts besides the API keys: the router's worker token when the
    instance has the model's shared secret (prefill and decode in a deployment)."""
    worker = args.engine.disagg.worker_token
    return (worker,) if worker else ()


def trace_trust(args: ServerArgs) -> Trust:
    """Whose sampled flag this instance's traces follow (`tracing.Trust`): a monolithic server's callers are
    clients; a worker with the model's secret knows the router by its token; one without is called by the
    router alone."""
    if args.engine.disagg.role is Role.MONOLITHIC:
        return Trust.NONE
    return Trust.PEER if peer_keys(args) else Trust.ALL


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
    signals = Signals()
    try:
        await server.start()
        if banner:
            print(banner, flush=True)
        await signals.stop.wait()
        await server.drain(signals.hurry)
    finally:
        await server.stop()


def run(args: ServerArgs, parts: Sequence[AppPart] = ()) -> None:
    """Serve until SIGTERM; `parts` join the HTTP app (`EngineServer`)."""
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
    asyncio.run(serve_until_signalled(EngineServer(args, parts), banner))
