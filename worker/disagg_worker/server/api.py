"""OpenAI-compatible HTTP API of one engine instance (aiohttp): the app, its middlewares, and the routes that
report on the instance (/v1/models, /health, /metrics, /stats) or act on it (/flush_cache). The generation
endpoints are `endpoints/`'s, one module each over a shared base.

Every client error is an `APIError` with an OpenAI-style body and a 4xx status; the middleware turns
anything else into a 500 whose message points at the log entry (an id), never at the exception, so
a bug never kills the server (`http/errors.py`). Generation requests pass the admission gate first
(`http/admission.py`: 503 when draining or broken, 429 over the in-flight bound, 413 over the body limit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from typing import Protocol

from aiohttp import web
from aiohttp.typedefs import Handler

from disagg_worker.env import WorkerEnv, load_env
from disagg_worker.http.admission import DRAINING, Admission
from disagg_worker.http.middlewares import with_tracing
from disagg_worker.request.errors import APIError
from disagg_worker.request.limits import body_limit_bytes
from disagg_worker.request.messages import FlushCacheReq, SchedulerStats
from disagg_worker.server.endpoints.chat import add_chat_route
from disagg_worker.server.endpoints.completions import add_completion_route
from disagg_worker.server.endpoints.generate import add_generate_route
from disagg_worker.server.endpoints.responses import add_response_routes
from disagg_worker.server.endpoints.tokenize import add_tokenize_routes
from disagg_worker.server.frontend import Frontend
from disagg_worker.server.health import health_report
from disagg_worker.server.kv_events_api import kv_events_handler
from disagg_worker.server.response_store import ResponseStore


class AppPart(Protocol):
    """A part composed above the server that joins its app (the decode's hand-off for gateways,
    `router/decode_handoff.py`): a middleware run on every request after admission, and a cleanup context that
    holds what it needs while the app runs (aiohttp's `cleanup_ctx`)."""

    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse: ...

    def context(self, app: web.Application) -> AsyncIterator[None]: ...


FRONTEND = web.AppKey("frontend", Frontend)
ADMISSION = web.AppKey("admission", Admission)
SETTINGS = web.AppKey("settings", dict)


def build_app(
    frontend: Frontend,
    model_name: str,
    health_timeout_s: float = 20.0,
    max_inflight: int = 256,
    identity: WorkerEnv | None = None,
    local_prefill: bool = False,
    responses: ResponseStore | None = None,
    client_body_budget: int | None = None,
    parts: Sequence[AppPart] = (),
    adapters: Sequence[str] = (),
) -> web.Application:
    """`local_prefill`: a decode instance that computes the prompts the router marks so (/health says it);
    `responses`: where a monolithic server keeps its Responses API answers (a P/D worker keeps none);
    `client_body_budget`: what one client's bodies may hold of the body budget (None: all of it).
    With the frontend's tracer, generation requests get spans (`http/traced.py`); `parts`: what joins the app
    from above (none: the instance serves its own endpoints only); `adapters`: the LoRA adapters' names, served
    by the completions and chat endpoints and listed by /v1/models with the model as their parent."""
    admission = Admission(
        max_inflight, lambda: body_limit_bytes(frontend.limits.max_context_len), client_budget=client_body_budget
    )
    middlewares = [*with_tracing(frontend.tracer, admission), *(as_middleware(p) for p in parts)]
    # aiohttp's own cap stays as a backstop; read_body enforces the real limit first.
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.extend(p.context for p in parts)
    app[FRONTEND] = frontend
    app[ADMISSION] = admission
    identity = identity if identity is not None else load_env()  # built once, at start-up
    app[SETTINGS] = {"model": model_name, "health_timeout_s": health_timeout_s, "identity": identity}
    app[SETTINGS]["local_prefill"] = local_prefill
    app[SETTINGS]["adapters"] = list(adapters)
    add_completion_route(app, frontend_of, model_name, adapters)
    add_chat_route(app, frontend_of, model_name, adapters)
    add_generate_route(app, frontend_of)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/kv_events", kv_events_handler(lambda: frontend.kv_log))
    add_tokenize_routes(app, frontend_of, model_name)
    add_response_routes(app, frontend_of, model_name, responses)
    return app


def as_middleware(part: AppPart):
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await part.middleware(request, handler)

    return middleware


def frontend_of(request: web.Request) -> Frontend:
    return request.app[FRONTEND]


async def models(request: web.Request) -> web.Response:
    """The served model, with its context as vLLM reports it (`max_model_len`; the router's body limit follows it),
    then its LoRA adapters, each with the model as its `parent` (vLLM's shape)."""
    name, context = request.app[SETTINGS]["model"], request.app[FRONTEND].limits.max_context_len
    model = {"id": name, "object": "model", "created": 0, "owned_by": "disagg", "max_model_len": context}
    adapters = [{**model, "id": a, "parent": name} for a in request.app[SETTINGS]["adapters"]]
    return web.json_response({"object": "list", "data": [model, *adapters]})


async def health(request: web.Request) -> web.Response:
    """200 while the instance serves; 503 with a reason when it drains, lost its scheduler or stalls.
    Either way the body names the pod, its pairing revision, its queues and transfer counters."""
    fe, s, admission = request.app[FRONTEND], request.app[SETTINGS], request.app[ADMISSION]
    report = health_report(fe.stats, s["identity"], fe.group_stats, fe.dp_size)
    if s["local_prefill"]:  # the router sends such a decode prompts to compute itself (conditional disaggregation)
        report["local_prefill"] = True
    if s["adapters"]:  # the router pairs a request for an adapter only with instances that hold it
        report["lora_adapters"] = s["adapters"]
        # ... and prefers those where it is resident (no load into a slot, no wait for one).
        report["lora_resident"] = list(fe.stats.lora_resident) if fe.stats is not None else []
    if admission.draining:
        reason = "the instance is shutting down: it finishes the requests it holds and takes no new ones"
        return web.json_response({"status": DRAINING, "reason": reason, **report}, status=503)
    failed = fe.failed or next((g.broken for g in fe.group_stats.values() if g.broken), "")
    if failed:
        return web.json_response({"status": "unhealthy", "reason": failed, **report}, status=503)
    if fe.healthy(s["health_timeout_s"]):
        return web.json_response({"status": "ok", **report})
    reason = "the scheduler has not reported recently"
    return web.json_response({"status": "unhealthy", "reason": reason, **report}, status=503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[FRONTEND].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def stats(request: web.Request) -> web.Response:
    """The scheduler's latest report: queue sizes and page accounting (with DP attention, the groups' sums and
    each group's own report under `groups`)."""
    fe = request.app[FRONTEND]
    st = fe.stats
    if st is None:
        raise APIError(503, "the scheduler has not reported yet", type="server_error")
    report = stats_body(st)
    if fe.dp_size > 1:
        report["groups"] = [stats_body(fe.group_stats[g]) for g in sorted(fe.group_stats)]
    return web.json_response(report)


def stats_body(st: SchedulerStats) -> dict:
    report = asdict(st)
    report.pop("metrics_text", None)  # served on /metrics
    report["rank_queues"] = [
        {"tp_rank": tp, "pp_rank": pp, "queues": queues} for (tp, pp), queues in sorted(st.rank_queues.items())
    ]
    return report


async def flush_cache(request: web.Request) -> web.Response:
    await request.app[FRONTEND].send_all(FlushCacheReq())
    return web.json_response({"status": "ok"})
