"""The router's health probes: a worker that says it cannot serve (503) or refuses the connection leaves
rotation at once; one that is only slow to answer leaves after RouterTuning.health_timeouts_to_unhealthy
probes in a row time out, and one late answer costs nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
from aiohttp import web

from disagg_worker.router import discovery
from disagg_worker.router.workers import Worker, WorkerPool
from disagg_worker.tuning import TUNING, RouterTuning


async def _probes(answers: list[str]) -> list[bool]:
    """Serve /health as `answers` says, one per probe ("ok", "503", "slow"); the worker's health after each."""
    queue = list(answers)

    async def health(request: web.Request) -> web.Response:
        kind = queue.pop(0)
        if kind == "slow":
            await asyncio.sleep(1.0)
        status = 503 if kind == "503" else 200
        return web.json_response({"status": "ok" if status == 200 else "unhealthy"}, status=status)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"max_model_len": 64}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    worker = Worker(f"http://127.0.0.1:{port}", "decode")
    pool = WorkerPool(static=[worker])
    seen = []
    try:
        async with aiohttp.ClientSession() as session:
            for _ in answers:
                await pool.check_health(session)
                seen.append(worker.healthy)
    finally:
        await runner.cleanup()
    return seen


def _with_short_timeout(monkeypatch) -> None:
    fast = dataclasses.replace(TUNING, router=RouterTuning(health_timeout_s=0.2, health_timeouts_to_unhealthy=2))
    monkeypatch.setattr(discovery, "TUNING", fast)


def test_one_late_answer_keeps_a_worker_in_rotation_two_take_it_out(monkeypatch):
    _with_short_timeout(monkeypatch)
    got = asyncio.run(_probes(["ok", "slow", "ok", "slow", "slow", "ok"]))
    assert got == [True, True, True, True, False, True]


def test_a_503_takes_a_worker_out_at_once(monkeypatch):
    _with_short_timeout(monkeypatch)
    assert asyncio.run(_probes(["ok", "503", "ok"])) == [True, False, True]


def test_a_worker_never_healthy_stays_out_while_it_times_out(monkeypatch):
    _with_short_timeout(monkeypatch)
    assert asyncio.run(_probes(["slow", "ok"])) == [False, True]


def test_a_refused_connection_takes_a_worker_out_at_once():
    async def run() -> bool:
        worker = Worker("http://127.0.0.1:9", "prefill", healthy=True)  # discard port: nothing listens
        async with aiohttp.ClientSession() as session:
            await WorkerPool(static=[worker]).check_health(session)
        return worker.healthy

    assert asyncio.run(run()) is False
