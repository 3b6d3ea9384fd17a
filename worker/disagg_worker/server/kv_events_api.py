"""GET /kv_events: the instance's prefix-cache pages for a router's index (mem/kv_events.py).

`?epoch=E&since=N` (both optional): the events after event N of epoch E, or a snapshot of every page held when
the reader missed some or names another epoch (an instance restarted, or a reader that never asked). Pages are
16 hex digits each; the header names the hash scheme, the id of the key naming the pages (`key_id`, "" when
unkeyed), page size and model so that a router can refuse to mix instances that would name the same prefix
differently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from disagg_worker.mem.kv_events import EventLog
from disagg_worker.request.errors import APIError


def kv_events_handler(log: Callable[[], EventLog]) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def kv_events(request: web.Request) -> web.Response:
        epoch = request.query.get("epoch", "")
        try:
            since = int(request.query.get("since", "-1"))
        except ValueError:
            msg = "since must be an integer (the sequence number of the last event read)"
            raise APIError(400, msg, param="since") from None
        return web.json_response(log().since(epoch, since))

    return kv_events
