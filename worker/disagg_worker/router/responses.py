"""The Responses API through the router: `POST /v1/responses` routed like a chat (a prefill/decode pair,
a bootstrap room, the same retries; the workers serve the Responses API natively), and the store of
responses (`server/response_store.py`) that `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`
read.

The store is the router's, since a follow-up may land on any pair: a request that continues a stored
response is sent with the whole conversation as its `input` (its `previous_response_id` kept, for the
answer to echo), and the answer is stored when decode's response (or its stream's `response.completed`)
arrives. It lives in this router replica's memory: behind several replicas a follow-up must reach the
replica that answered the first turn (session affinity), or else send the whole conversation itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from aiohttp import web

from disagg_worker.http.admission import body_of
from disagg_worker.http.auth import caller_of
from disagg_worker.router.app import ROUTER, Opened, Router
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.stream import DONE, UpstreamLost, read_chunk, sse_response
from disagg_worker.server.protocol import parse_json
from disagg_worker.server.response_store import ResponseStore
from disagg_worker.server.responses_input import input_items

log = logging.getLogger(__name__)
PATH = "/v1/responses"
STORE = web.AppKey("responses", ResponseStore)
FINAL = ("response.completed", "response.incomplete")


async def create(request: web.Request) -> web.StreamResponse:
    router, store, owner = request.app[ROUTER], request.app[STORE], caller_of(request)
    body = parse_json(body_of(request))
    earlier = store.continued(body, owner)
    if earlier is not None:
        body = {**body, "input": [*earlier, *input_items(body)]}
    conversation = input_items(body)
    o = await router.open(PATH, SharedBody.of(body), {})
    try:
        if not o.resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            if o.resp.status == 200:
                store.put(json.loads(o.first), conversation, owner)
            return web.Response(body=o.first, status=o.resp.status, content_type="application/json")
        out = await sse_response(request, router.client_write_timeout_s)
        await _relay(router, out, o, lambda r: store.put(r, conversation, owner))
        return out
    except (asyncio.CancelledError, ConnectionResetError):
        if o.prefill is not None:
            o.prefill.cancel()  # the client left (or stopped reading): abort the prefill side too
        raise
    finally:
        router.close(o)


async def _relay(router: Router, out: web.StreamResponse, o: Opened, on_final: Callable[[dict], None]) -> None:
    """Decode's events passed on as they come, the final response kept; a lost stream ends with an error event."""
    buf = o.first
    try:
        while True:
            end = buf.rfind(b"\n\n") + 2
            if end >= 2:
                complete, buf = buf[:end], buf[end:]
                _final(complete, on_final)
                await out.write(complete)
                if complete.endswith(DONE):
                    return
            # No stall deadline: a Responses stream does not migrate, and one writing a function call sends
            # nothing until the call is whole.
            buf += await read_chunk(o.resp)
    except UpstreamLost as e:
        log.warning("decode %s: %s", o.decode.url, e.message)
        error = {"type": "error", "code": "upstream_error", "message": router.cut_reason or e.message, "param": None}
        await out.write(f"event: error\ndata: {json.dumps(error)}\n\n".encode() + DONE)


def _final(events: bytes, on_final: Callable[[dict], None]) -> None:
    for event in events.split(b"\n\n"):
        if not event.startswith(b"event: response.") or not any(k.encode() in event[:40] for k in FINAL):
            continue
        data = event.partition(b"\ndata: ")[2]
        try:
            on_final(json.loads(data)["response"])
        except (ValueError, KeyError, TypeError):
            log.warning("decode sent a final response event that is not JSON: not stored")


async def get(request: web.Request) -> web.Response:
    return web.json_response(request.app[STORE].get(request.match_info["id"], owner=caller_of(request)).response)


async def delete(request: web.Request) -> web.Response:
    return web.json_response(request.app[STORE].delete(request.match_info["id"], caller_of(request)))


def add_responses(app: web.Application, store: ResponseStore) -> None:
    app[STORE] = store
    app.router.add_post(PATH, create)
    app.router.add_get(PATH + "/{id}", get)
    app.router.add_delete(PATH + "/{id}", delete)
