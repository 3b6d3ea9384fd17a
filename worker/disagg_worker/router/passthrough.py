"""Requests any one worker answers alike, passed through unchanged: /tokenize and /detokenize (the
tokenizer is the same on every worker of a model). A healthy decode worker answers (a prefill when no
decode is healthy); a worker lost on the way is a 502, none healthy a 503."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web

from disagg_worker.http.admission import RETRY_AFTER_S, body_of
from disagg_worker.request.errors import APIError, unavailable
from disagg_worker.router.app import ROUTER

log = logging.getLogger(__name__)
PATHS = ("/tokenize", "/detokenize")


async def pass_through(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    worker = router.pool.pick("decode") or router.pool.pick("prefill")
    if worker is None:
        raise unavailable("No healthy worker is available; retry later.", retry_after=RETRY_AFTER_S)
    body = body_of(request)  # read by the admission, within its time limit and byte budget
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    try:
        async with router.session.post(
            f"{worker.url}{request.path}", data=body, headers=headers, timeout=router.timeout
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        log.warning("%s: worker %s failed: %r", request.path, worker.url, e)
        raise APIError(502, f"The worker answering {request.path} failed; retry the request.", "server_error") from e


def add_pass_through(app: web.Application) -> None:
    for path in PATHS:
        app.router.add_post(path, pass_through)
