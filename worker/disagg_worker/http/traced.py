"""The HTTP side of tracing (`disagg_worker.tracing`): a generation request's server span and its admission.

Installed only when tracing is on: `traced_middlewares` gives the middleware that goes first (the request's
span, a child of the `traceparent` it came with, sampled as `Tracer.trust` says for a request from the router or
from a client, current while it is handled) and the one that goes after the
admission gate (`admission` from the request's arrival to that point: its body read and a slot taken).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from disagg_worker.http.admission import GENERATION_PATHS
from disagg_worker.http.auth import from_peer
from disagg_worker.tracing import Tracer

_ARRIVED: Any = web.RequestKey("trace_arrived", int) if hasattr(web, "RequestKey") else "disagg.trace_arrived"


def traced_middlewares(tracer: Tracer) -> tuple[Any, Any]:
    """(the outermost middleware, the one after admission) of an app whose process's spans `tracer` makes."""

    @web.middleware
    async def span(request: web.Request, handler):
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        request[_ARRIVED] = arrived = time.time_ns()
        name = f"{tracer.role} {request.method} {request.path}"
        attrs = {"disagg.role": tracer.role, "http.request.method": request.method, "http.route": request.path}
        with tracer.server_span(name, request.headers, arrived, from_peer(request), **attrs) as s:
            response = await handler(request)
            s.set_attribute("http.response.status_code", response.status)
            return response

    @web.middleware
    async def admitted(request: web.Request, handler):
        parent = tracer.current() if _ARRIVED in request else None
        if parent is not None:
            tracer.span_between("admission", parent, request[_ARRIVED])
        return await handler(request)

    return span, admitted
