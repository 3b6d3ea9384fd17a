"""HTTP handlers of the router, and its entry point."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from disagg_worker.router.app import ROUTER, Router
from disagg_worker.router.auth import RouterAuth, add_auth_args
from disagg_worker.router.workers import DnsSource, Policy, Worker, WorkerPool
from disagg_worker.server.api import error_middleware
from disagg_worker.server.auth import require_keys
from disagg_worker.server.errors import APIError
from disagg_worker.server.protocol import parse_json

log = logging.getLogger(__name__)
MAX_N = 16


def build_router_app(router: Router) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 * 1024 * 1024)
    app[ROUTER] = router
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, make_handler(path))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def make_handler(path: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        router = request.app[ROUTER]
        body = parse_json(await request.read())
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        n = body.get("n", 1)
        if path != "/generate" and type(n) is int and 1 < n <= MAX_N:
            return await fan_out(request, router, path, body, n)
        return await proxy_one(request, router, path, body)

    return handler


async def proxy_one(request: web.Request, router: Router, path: str, body: dict) -> web.StreamResponse:
    resp, prefill, first, held = await router.open(path, body)
    try:
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return web.Response(body=first, status=resp.status, content_type="application/json")
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        await out.write(first)
        async for chunk in resp.content.iter_any():
            await out.write(chunk)
        return out
    except asyncio.CancelledError:
        prefill.cancel()  # the client left: abort the prefill side too
        raise
    finally:
        resp.release()
        for w in held:
            w.inflight -= 1


def sub_request(body: dict, i: int) -> dict:
    sub = {**body, "n": 1}
    seed = body.get("seed")
    if type(seed) is int:
        sub["seed"] = seed + i
    return sub


async def fan_out(request: web.Request, router: Router, path: str, body: dict, n: int) -> web.StreamResponse:
    """n choices = n single-choice requests, each on its own pair and bootstrap room."""
    opened = await asyncio.gather(*(router.open(path, sub_request(body, i)) for i in range(n)), return_exceptions=True)
    try:
        ok = [o for o in opened if not isinstance(o, BaseException)]
        failed = next((o for o in opened if isinstance(o, BaseException)), None)
        if failed is not None:
            raise failed
        if body.get("stream") is not True:
            return web.json_response(merge_bodies([json.loads(o[2]) for o in ok]))
        return await stream_merged(request, ok, body)
    finally:
        for o in opened:
            if not isinstance(o, BaseException):
                o[0].release()
                for w in o[3]:
                    w.inflight -= 1


def merge_bodies(bodies: list[dict]) -> dict:
    merged = dict(bodies[0])
    merged["choices"] = []
    for i, b in enumerate(bodies):
        for c in b.get("choices", []):
            merged["choices"].append({**c, "index": i})
    usage = dict(bodies[0].get("usage") or {})
    usage["completion_tokens"] = sum((b.get("usage") or {}).get("completion_tokens", 0) for b in bodies)
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
    merged["usage"] = usage
    return merged


async def sse_events(first: bytes, resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    buf = first
    while True:
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            line = event.decode(errors="replace").strip()
            if line.startswith("data: "):
                yield line[6:]
        chunk = await resp.content.readany()
        if not chunk:
            return
        buf += chunk


async def stream_merged(request: web.Request, opened: list, body: dict) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    queue: asyncio.Queue = asyncio.Queue()
    usage: dict = {}
    ids: list[str] = []  # one response id for all choices: the first one seen

    async def pump(i: int, first: bytes, resp: aiohttp.ClientResponse) -> None:
        async for data in sse_events(first, resp):
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "usage" in event and not event.get("choices"):
                usage.setdefault("prompt_tokens", event["usage"].get("prompt_tokens", 0))
                usage["completion_tokens"] = usage.get("completion_tokens", 0) + event["usage"]["completion_tokens"]
                usage["last"] = event
                continue
            for c in event.get("choices", []):
                c["index"] = i
            if "id" in event:
                ids[:] = ids or [event["id"]]
                event["id"] = ids[0]
            await queue.put(event)
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, o[2], o[0])) for i, o in enumerate(opened)]
    try:
        remaining = len(tasks)
        while remaining:
            event = await queue.get()
            if event is None:
                remaining -= 1
                continue
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
        if "last" in usage:
            last = usage.pop("last")
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            last["usage"] = {**last["usage"], **usage}
            last["id"] = ids[0] if ids else last.get("id")
            await out.write(f"data: {json.dumps(last)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
    finally:
        for t in tasks:
            t.cancel()
    return out


async def models(request: web.Request) -> web.Response:
    name = request.app[ROUTER].model_name
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "disagg"}]}
    )


async def health(request: web.Request) -> web.Response:
    """Healthy while at least one prefill and one decode instance are; lists every worker."""
    pool = request.app[ROUTER].pool
    workers = [w.describe() for w in pool.workers()]
    ok = pool.pick("prefill") is not None and pool.pick("decode") is not None
    return web.json_response({"status": "ok" if ok else "unhealthy", "workers": workers}, status=200 if ok else 503)


def parse_static(specs: list[list[str]], role: str) -> list[Worker]:
    """`--prefill URL [BOOTSTRAP_PORT]` / `--decode URL`."""
    workers = []
    for spec in specs or []:
        url = spec[0].rstrip("/")
        port = int(spec[1]) if role == "prefill" and len(spec) > 1 else 0
        workers.append(Worker(url, role, port))
    return workers


def build_pool(ns) -> WorkerPool:
    static = parse_static(ns.prefill, "prefill") + parse_static(ns.decode, "decode")
    dns = []
    if ns.prefill_dns:
        dns.append(DnsSource.parse(ns.prefill_dns, "prefill", ns.bootstrap_port))
    if ns.decode_dns:
        dns.append(DnsSource.parse(ns.decode_dns, "decode"))
    for w in static:
        if w.role == "prefill" and not w.bootstrap_port:
            w.bootstrap_port = ns.bootstrap_port
    return WorkerPool(static=static, dns=dns, policy=Policy(ns.policy))


def add_router_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="default")
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill instance and its bootstrap port (repeatable)",
    )
    p.add_argument("--decode", nargs=1, action="append", metavar="URL", help="a decode instance (repeatable)")
    p.add_argument("--prefill-dns", default="", help="HOST:PORT of a headless Service of prefill pods")
    p.add_argument("--decode-dns", default="", help="HOST:PORT of a headless Service of decode pods")
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--policy", default=Policy.ROUND_ROBIN.value, choices=[p.value for p in Policy])
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--log-level", default="info")
    add_auth_args(p)


async def serve(ns, auth: RouterAuth, ready: asyncio.Event | None = None) -> None:
    router = Router(build_pool(ns), ns.served_model_name, retries=ns.retries, auth=auth)
    await router.start(ns.health_interval)
    app = build_router_app(router)
    require_keys(app, auth.api_keys)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, ns.host, ns.port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"disagg router on http://{ns.host}:{ns.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await router.stop()


def run(ns) -> None:
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s router %(levelname)s %(message)s")
    auth = RouterAuth.from_cli(ns)  # before anything starts: a key asked for but missing stops here
    asyncio.run(serve(ns, auth))
