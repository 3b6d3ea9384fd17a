"""`POST /generate`, the native endpoint (SGLang's shape): token ids (or text) in, token ids and text out, whole
or streamed, each event the whole answer so far. The router's pair probe comes here (`PROBE_HEADER`)."""

from __future__ import annotations

from aiohttp import web

from disagg_worker.http.probe import PROBE_HEADER
from disagg_worker.request.route import route_of
from disagg_worker.server.endpoints.base import Choice, FrontendOf, ends_stream, read_json, send_event, sse_response
from disagg_worker.server.protocol import parse_generate


def add_generate_route(app: web.Application, frontend: FrontendOf) -> None:
    async def generate(request: web.Request) -> web.StreamResponse:
        """A router's pair probe (PROBE_HEADER) is served like any request but left out of the user-facing
        request metrics."""
        fe = frontend(request)
        body = await read_json(fe, request)
        req = parse_generate(body, fe.limits)
        if req.input_ids is not None:  # admitted while parsing
            ids, params = req.input_ids, req.sampling
        else:
            ids = await fe.encode(req.text or "")
            params = fe.limits.admit(ids, req.sampling, req.max_tokens_set, "sampling_params.max_new_tokens", "text")
        route = route_of(body)
        fe.check_route(route, params)
        choice = Choice(0)
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

    app.router.add_post("/generate", generate)


def generate_body(c: Choice, prompt_tokens: int) -> dict:
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
