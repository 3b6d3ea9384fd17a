"""How the router opens a choice on a pair, against fake prefill and decode servers on 127.0.0.1:
a prefill that refuses first cancels decode's half at once, a draining worker is no longer
picked, and a retry replaces only the side that failed."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from disagg_worker.request.errors import APIError, unavailable
from disagg_worker.router.app import Opened, Router
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.workers import Worker, WorkerPool

BODY = SharedBody.of({"prompt": "hi", "max_tokens": 2})


def prefill_app(answer: str) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        if answer == "draining":
            return web.json_response(unavailable("shutting down", 1, "draining").body(), status=503)
        return web.json_response({"choices": [{"text": "x"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


def decode_app(behaviour: str, seen: dict) -> web.Application:
    """ "hang": waits for KV forever (notes when it is cancelled); "drop": closes the connection; "ok": answers."""

    async def handle(request: web.Request) -> web.Response:
        seen["body"] = json.loads(await request.read())
        if behaviour == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen["cancelled"] = True
                raise
        if behaviour == "drop":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(1)
        return web.json_response({"choices": [{"text": "ok"}]})

    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_post("/v1/completions", handle)
    return app


async def with_router(prefills: list[web.Application], decodes: list[web.Application], check) -> None:
    servers = [TestServer(a) for a in prefills + decodes]
    for s in servers:
        await s.start_server()
    workers = [Worker(f"http://127.0.0.1:{s.port}", "prefill", 1, healthy=True) for s in servers[: len(prefills)]]
    workers += [Worker(f"http://127.0.0.1:{s.port}", "decode", healthy=True) for s in servers[len(prefills) :]]
    router = Router(WorkerPool(static=workers), "tiny", retries=2)
    router._session = aiohttp.ClientSession()
    try:
        await check(router, workers)
    finally:
        await router.session.close()
        for s in servers:
            await s.close()


def test_a_prefill_that_refuses_first_cancels_decode_at_once():
    seen: dict = {}

    async def check(router: Router, workers: list[Worker]) -> None:
        start = asyncio.get_running_loop().time()
        with pytest.raises(APIError) as e:
            await router.open("/v1/completions", BODY, {})
        assert asyncio.get_running_loop().time() - start < 3, "decode's half was not waited for"
        assert (e.value.status, e.value.code, e.value.retry_after) == (503, "draining", 1)
        assert not workers[0].healthy, "a draining prefill is not picked again"
        await asyncio.sleep(0.2)
        assert seen.get("cancelled"), "decode's half was cancelled"
        assert workers[1].inflight == 0 and workers[0].inflight == 0

    asyncio.run(with_router([prefill_app("draining")], [decode_app("hang", seen)], check))


def test_a_retry_replaces_only_the_decode_that_failed():
    dropped: dict = {}
    served: dict = {}

    async def check(router: Router, workers: list[Worker]) -> None:
        opened = await router.open("/v1/completions", BODY, {"n": 1})
        assert isinstance(opened, Opened)
        assert json.loads(opened.first) == {"choices": [{"text": "ok"}]}
        assert opened.decode is workers[2], "the second decode answered, with the same prefill"
        assert dropped["body"]["bootstrap_room"] != served["body"]["bootstrap_room"], "a fresh room per attempt"
        assert served["body"]["prompt"] == "hi" and served["body"]["n"] == 1
        router.close(opened)
        assert all(w.inflight == 0 for w in workers)

    apps = [decode_app("drop", dropped), decode_app("ok", served)]
    asyncio.run(with_router([prefill_app("ok")], apps, check))
