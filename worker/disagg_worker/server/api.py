"""OpenAI-compatible HTTP API of one engine instance (aiohttp).

Every client error is an `APIError` with an OpenAI-style body and a 4xx status; the middleware turns
anything else into a 500 whose message points at the log entry (an id), never at the exception, so
a bug never kills the server. Generation requests pass the admission gate first (`admission.py`:
503 when draining or broken, 429 over the in-flight bound, 413 over the body limit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, replace

from aiohttp import web

from disagg_worker.env import WorkerEnv, load_env
from disagg_worker.request.errors import APIError, internal_error
from disagg_worker.request.limits import body_limit_bytes
from disagg_worker.request.messages import FlushCacheReq, Route, SchedulerStats
from disagg_worker.request.params import SamplingParams
from disagg_worker.request.route import route_of
from disagg_worker.server import openai_format as fmt
from disagg_worker.server.admission import DRAINING, Admission, admission_middleware, body_of
from disagg_worker.server.chat_input import chat_input
from disagg_worker.server.echo import Echo, prompt_text
from disagg_worker.server.frontend import Delta, Frontend
from disagg_worker.server.health import health_report
from disagg_worker.server.interleave import merged
from disagg_worker.server.kv_events_api import kv_events_handler
from disagg_worker.server.metrics import PROBE_HEADER
from disagg_worker.server.protocol import parse_chat, parse_completion, parse_generate, parse_json
from disagg_worker.server.response_store import ResponseStore
from disagg_worker.server.responses_api import add_response_routes
from disagg_worker.server.tokenize_api import add_tokenize_routes
from disagg_worker.server.tool_calls import ChatTools, ToolStream, call_deltas
from disagg_worker.server.traced import traced_middlewares
from disagg_worker.tracing import Tracer

log = logging.getLogger(__name__)

FRONTEND = web.AppKey("frontend", Frontend)
ADMISSION = web.AppKey("admission", Admission)
SETTINGS = web.AppKey("settings", dict)


def error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers())


def logged_internal_error(request: web.Request) -> APIError:
    """Log the exception being handled under a fresh id; the client's message names the id only."""
    ref = uuid.uuid4().hex[:12]
    log.exception("internal error %s on %s %s", ref, request.method, request.path)
    return internal_error(ref)


def request_id(request: web.Request) -> str:
    """The id a log line names a request by: the client's `X-Request-Id`, else one made for it (kept on it)."""
    if "request_id" not in request:
        request["request_id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:12]
    return request["request_id"]


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(APIError(e.status, e.reason or "error", type="invalid_request_error"))
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client left (mid-body, mid-stream): normal, not an error
        log.debug(
            "request %s (%s %s): the client left before its answer", request_id(request), request.method, request.path
        )
        return web.Response(status=499)  # nobody reads it: aiohttp drops it quietly on the closed connection
    except Exception:  # a bug: a 500 that points at the log, and keep serving
        return error_response(logged_internal_error(request))


def build_app(
    frontend: Frontend,
    model_name: str,
    health_timeout_s: float = 20.0,
    max_inflight: int = 256,
    identity: WorkerEnv | None = None,
    local_prefill: bool = False,
    responses: ResponseStore | None = None,
) -> web.Application:
    """`local_prefill`: a decode instance that computes the prompts the router marks so (/health says it);
    `responses`: where a monolithic server keeps its Responses API answers (a P/D worker keeps none).
    With the frontend's tracer, generation requests get spans (`traced.py`)."""
    admission = Admission(max_inflight, lambda: body_limit_bytes(frontend.limits.max_context_len))
    # aiohttp's own cap stays as a backstop; read_body enforces the real limit first.
    app = web.Application(middlewares=with_tracing(frontend.tracer, admission), client_max_size=64 * 1024 * 1024)
    app[FRONTEND] = frontend
    app[ADMISSION] = admission
    identity = identity if identity is not None else load_env()  # built once, at start-up
    app[SETTINGS] = {"model": model_name, "health_timeout_s": health_timeout_s, "identity": identity}
    app[SETTINGS]["local_prefill"] = local_prefill
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/kv_events", kv_events_handler(lambda: frontend.kv_log))
    add_tokenize_routes(app, lambda request: request.app[FRONTEND], model_name)
    add_response_routes(app, lambda request: request.app[FRONTEND], model_name, responses)
    return app


def with_tracing(tracer: Tracer | None, admission: Admission) -> list:
    """The middlewares of a front end: errors, admission, and with a tracer the request's span around them."""
    middlewares = [error_middleware, admission_middleware(admission)]
    if tracer is None:
        return middlewares
    first, admitted = traced_middlewares(tracer)
    return [first, *middlewares, admitted]


async def read_json(request: web.Request):
    return await request.app[FRONTEND].parse(body_of(request), parse_json)


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: a seeded request gets seed + i so the choices differ but stay reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + i)


async def run_choices(frontend: Frontend, ids, params, n, route: Route) -> list[fmt.Choice]:
    choices = [fmt.Choice(i) for i in range(n)]
    streams = [frontend.complete(ids, choice_params(params, i), route) for i in range(n)]
    async for i, d in merged(streams):
        choices[i].add(d)
    return choices


async def sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, data) -> None:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    await resp.write(f"data: {payload}\n\n".encode())


@asynccontextmanager
async def ends_stream(request: web.Request, resp: web.StreamResponse) -> AsyncIterator[None]:
    """A stream always ends with [DONE]; a failure inside it comes first, as an OpenAI error event."""
    try:
        yield
    except APIError as e:
        await send_event(resp, e.body())
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client left: nobody reads the rest
    except Exception:
        await send_event(resp, logged_internal_error(request).body())
    await send_event(resp, "[DONE]")


async def completions(request: web.Request) -> web.StreamResponse:
    fe, s = request.app[FRONTEND], request.app[SETTINGS]
    body = await read_json(request)
    req = parse_completion(body, s["model"], fe.limits)
    if isinstance(req.prompt, list):  # admitted while parsing
        ids, params = req.prompt, req.sampling
    else:
        ids = await fe.encode(req.prompt)
        params = fe.limits.admit(ids, req.sampling, req.max_tokens_set)
    return await respond(
        request,
        ids,
        params,
        req.n,
        route_of(body),
        req.stream,
        req.stream_options_include_usage,
        chat=False,
        token_ids=wants_token_ids(body),
        echo=Echo(ids, prompt_text(fe.tokenizer, req.prompt), req.echo_only, params.logprobs is not None)
        if req.echo
        else None,
    )


def wants_token_ids(body: dict) -> bool:
    """vLLM's `return_token_ids`: each choice (and each streamed chunk) carries its token ids."""
    value = body.get("return_token_ids", False)
    if not isinstance(value, bool):
        raise APIError(400, "return_token_ids must be a boolean", param="return_token_ids")
    return value


async def chat_completions(request: web.Request) -> web.StreamResponse:
    fe, s = request.app[FRONTEND], request.app[SETTINGS]
    body = await read_json(request)
    req = parse_chat(body, s["model"], fe.limits)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ids, params, tools = await chat_input(fe, req, key)
    usage = req.stream_options_include_usage
    route, token_ids = route_of(body), wants_token_ids(body)
    return await respond(
        request, ids, params, req.n, route, req.stream, usage, chat=True, tools=tools, token_ids=token_ids
    )


async def respond(
    request: web.Request,
    ids: list[int],
    params: SamplingParams,
    n: int,
    route: Route,
    stream: bool,
    include_usage: bool,
    chat: bool,
    tools: ChatTools | None = None,
    token_ids: bool = False,
    echo: Echo | None = None,
) -> web.StreamResponse:
    """Run n choices and answer as a completion or chat completion, whole or streamed (SSE); with tools, a
    chat answer's calls are parsed out of its text (`tool_calls.py`)."""
    fe, model, tok = request.app[FRONTEND], request.app[SETTINGS]["model"], request.app[FRONTEND].tokenizer
    rid = fmt.new_id("chatcmpl" if chat else "cmpl")
    if not stream:
        choices = await run_choices(fe, ids, params, n, route)
        body = (fmt.chat_body if chat else fmt.completion_body)(rid, model, choices, tok, len(ids))
        if tools is not None:
            body["choices"] = [tools.answer(c) for c in body["choices"]]
        if echo is not None:
            body["choices"] = [echo.whole(tok, answer, c) for answer, c in zip(body["choices"], choices, strict=True)]
            echo.usage(body)
        if token_ids:
            for c, answer in zip(choices, body["choices"], strict=True):
                answer["token_ids"] = c.token_ids
        return web.json_response(body)
    fe.check_resume(route, params)  # a 400, before the stream's 200
    resp = await sse_response(request)
    choices = [fmt.Choice(i) for i in range(n)]
    calls = [tools.stream() for _ in range(n)] if tools is not None else None
    # A migrated request's stream goes on from where the client is: its role came with the first stream.
    started: set[int] = set(range(n)) if route.resume else set()
    async with ends_stream(request, resp):
        async for i, d in merged([fe.complete(ids, choice_params(params, i), route) for i in range(n)]):
            if chat:  # the role comes with the first token: a stream's first event is output or an error
                shown = d if calls is None else tool_delta(calls[i], d)
                chunk = fmt.chat_chunk(rid, model, i, shown, tok, first=i not in started)
                if calls is not None and d.finish_reason is not None:
                    end_with_calls(chunk, calls[i])
            else:
                # A migrated stream's text goes on after what the client has (`resume_chars`).
                offset = route.resume_chars + len(choices[i].text) + (len(echo.prompt_text) if echo is not None else 0)
                chunk = fmt.completion_chunk(rid, model, i, d, tok, offset)
                if echo is not None and i not in started:
                    echo.first_chunk(tok, chunk["choices"][0], d)
            if token_ids:
                chunk["choices"][0]["token_ids"] = d.token_ids
            await send_event(resp, chunk)
            started.add(i)
            choices[i].add(d)
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            last = fmt.usage_chunk(rid, model, obj, choices, len(ids))
            if echo is not None:
                echo.usage(last)
            await send_event(resp, last)
    return resp


def tool_delta(calls: ToolStream, d: Delta) -> Delta:
    """`d` with the text a possible tool call holds back taken out (and, at the end, what it released)."""
    text = calls.push(d.text)
    if d.finish_reason is not None:
        text += calls.finish(d.finish_reason)
    return replace(d, text=text)


def end_with_calls(chunk: dict, calls: ToolStream) -> None:
    """The last chunk of a choice carries its parsed calls, whole, and finish_reason "tool_calls"."""
    if calls.found:
        choice = chunk["choices"][0]
        choice["delta"]["tool_calls"] = call_deltas(calls.found)
        choice["finish_reason"] = "tool_calls"


async def generate(request: web.Request) -> web.StreamResponse:
    """Native endpoint: token ids (or text) in, token ids and text out. A router's pair probe (PROBE_HEADER)
    is served like any request but left out of the user-facing request metrics."""
    fe = request.app[FRONTEND]
    body = await read_json(request)
    req = parse_generate(body, fe.limits)
    if req.input_ids is not None:  # admitted while parsing
        ids, params = req.input_ids, req.sampling
    else:
        ids = await fe.encode(req.text or "")
        params = fe.limits.admit(ids, req.sampling, req.max_tokens_set, "sampling_params.max_new_tokens", "text")
    route = route_of(body)
    fe.check_resume(route, params)
    choice = fmt.Choice(0)
    if not req.stream:
        async for d in fe.complete(ids, params, route, probe=PROBE_HEADER in request.headers):
            choice.add(d)
        return web.json_response(generate_body(choice, len(ids)))
    resp = await sse_response(request)
    async with ends_stream(request, resp):
        async for d in fe.complete(ids, params, route):
            choice.add(d)
            await send_event(resp, generate_body(choice, len(ids)))
    return resp


def generate_body(c: fmt.Choice, prompt_tokens: int) -> dict:
    return {
        "text": c.text,
        "output_ids": c.token_ids,
        "meta_info": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": c.completion_tokens,
            "cached_tokens": c.cached_tokens,
            "finish_reason": c.finish_reason,
            "output_token_logprobs": c.logprobs or None,
        },
    }


async def models(request: web.Request) -> web.Response:
    """The served model, with its context as vLLM reports it (`max_model_len`); the router's body limit follows it."""
    name, context = request.app[SETTINGS]["model"], request.app[FRONTEND].limits.max_context_len
    model = {"id": name, "object": "model", "created": 0, "owned_by": "disagg", "max_model_len": context}
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    """200 while the instance serves; 503 with a reason when it drains, lost its scheduler or stalls.
    Either way the body names the pod, its pairing revision, its queues and transfer counters."""
    fe, s, admission = request.app[FRONTEND], request.app[SETTINGS], request.app[ADMISSION]
    report = health_report(fe.stats, s["identity"], fe.group_stats, fe.dp_size)
    if s["local_prefill"]:  # the router sends such a decode prompts to compute itself (conditional disaggregation)
        report["local_prefill"] = True
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
