"""A pod of a multi-node instance other than pod 0 (`--node-rank` above 0): it runs its share of the ranks and
nothing else. Its ranks follow the driver on pod 0 (`instance/follower.py`), meet the others at
`--dist-init-addr`, and register with pod 0's bootstrap server on prefill.

`GET /health` on its port answers 200 while every one of its ranks runs, 503 once one has ended; the process
then exits non-zero (after `EXIT_AFTER_S`, so that a probe can see why), and so does every rank on every pod:
the others notice at their next collective (idle ranks meet every second) and pod 0's front end fails its
requests with 503. A group of pods is restarted as one (LeaderWorkerSet's RecreateGroupOnPodRestart): ranks
cannot rejoin a running instance. SIGTERM stops its ranks and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from multiprocessing.process import BaseProcess

from aiohttp import web

from disagg_worker.config import ServerArgs
from disagg_worker.instance.process import spawn_schedulers

log = logging.getLogger(__name__)
EXIT_AFTER_S = 2.0


async def serve(args: ServerArgs) -> int:
    d = args.engine.disagg
    procs = spawn_schedulers(args.engine, "", "", args.log_level)
    ended: list[str] = []

    async def health(_: web.Request) -> web.Response:
        if ended:
            return web.json_response({"status": "failed", "reason": ended[0]}, status=503)
        return web.json_response({"status": "ok", "node_rank": d.node_rank, "ranks": list(d.local_ranks)})

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    log.info("pod %d of %d: ranks %s, meeting at %s", d.node_rank, d.nnodes, list(d.local_ranks), d.dist_init_addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        while not stop.is_set():
            dead = next((p for p in procs if not p.is_alive()), None)
            if dead is not None:
                ended.append(f"rank process {dead.name} exited with code {dead.exitcode}")
                log.error("%s: this pod's ranks stop, and the instance with them", ended[0])
                await asyncio.sleep(EXIT_AFTER_S)
                code = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass
    finally:
        _stop(procs)
        await runner.cleanup()
    return code


def _stop(procs: list[BaseProcess]) -> None:
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)  # a follower's default action: it ends
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def run(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s worker-node %(levelname)s %(message)s")
    return asyncio.run(serve(args))
