"""Errors at an HTTP front end (a worker's or the router's): every client error is an `APIError` answered with
its OpenAI-style body and its 4xx status; anything else becomes a 500 whose message points at the log entry (an
id), never at the exception, so a bug never kills the server. A client that leaves before its answer is normal:
logged at debug level, not as an error."""

from __future__ import annotations

import asyncio
import logging
import uuid

from aiohttp import web

from disagg_worker.request.errors import APIError, internal_error

log = logging.getLogger(__name__)


def error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers())


def request_id(request: web.Request) -> str:
    """The id a log line names a request by: the client's `X-Request-Id`, else one made for it (kept on it)."""
    if "request_id" not in request:
        request["request_id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex[:12]
    return request["request_id"]


def logged_internal_error(request: web.Request) -> APIError:
    """Log the exception being handled under a fresh id; the client's message names the id only."""
    ref = uuid.uuid4().hex[:12]
    log.exception("internal error %s on %s %s", ref, request.method, request.path)
    return internal_error(ref)


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
