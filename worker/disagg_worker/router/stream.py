"""Relaying decode's SSE streams to the client, so that a stream never ends silently.

An upstream stream is complete only when its `data: [DONE]` event arrived. If the upstream drops,
times out, or ends without it, the client's stream ends with an OpenAI-style error event and then
`data: [DONE]`: a client can always tell a truncated answer from a finished one.

`relay` passes one stream on chunk by chunk (complete events only); `choice_events` yields the
events of one choice of an `n > 1` request, for the router to merge them. Every stream to a client is a
`ClientStream`: a client that stops reading is disconnected after --client-write-timeout, and its request's
upstreams are given back, which aborts its choices on their decodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from disagg_worker.http.errors import request_id
from disagg_worker.request.errors import APIError

log = logging.getLogger(__name__)
DONE = b"data: [DONE]\n\n"
UPSTREAM_ERROR = "upstream_error"


class UpstreamLost(Exception):
    """The upstream stream ended before its [DONE]; the message says how, in words for the client, and `cause`
    in one word (`timeout`, `stall`, `ended`, `connection`, `error_event`) for the router's metrics."""

    def __init__(self, message: str, cause: str = "connection"):
        super().__init__(message)
        self.message = message
        self.cause = cause


def lost(role: str, e: BaseException | None, stalled: bool = False) -> UpstreamLost:
    """Name the way an upstream failed without echoing the exception itself."""
    if stalled:
        how, cause = "sent nothing for longer than the router waits for a stream's next event", "stall"
    elif isinstance(e, asyncio.TimeoutError):
        how, cause = "did not finish within the router's request timeout", "timeout"
    elif e is None:
        how, cause = "ended its stream before it was complete", "ended"
    else:
        how, cause = "closed the connection in the middle of the answer", "connection"
    return UpstreamLost(f"The {role} instance {how}; the answer is incomplete, retry the request.", cause)


def error_event(message: str, code: str = UPSTREAM_ERROR) -> bytes:
    body = APIError(502, message, "server_error", code=code).body()
    return f"data: {json.dumps(body)}\n\n".encode()


class ClientStalled(ConnectionResetError):
    """The client took no bytes of its stream within the router's write timeout: the router disconnected it.
    A ConnectionResetError, as for a client that left: its handler gives back (and aborts) every upstream."""


class ClientStream(web.StreamResponse):
    """The client's SSE stream, whose every write completes within `write_timeout_s` (None: no limit).

    A write waits only once the buffers towards the client are full: a client that stops reading holds it. Past
    the limit the connection is aborted (closing it would wait for the client to take what is buffered) and the
    write raises ClientStalled, so that a client that reads nothing cannot hold its choices, their decodes' pages
    and a router slot until the request timeout."""

    def __init__(self, request: web.Request, write_timeout_s: float | None) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        self._client = request
        self.write_timeout_s = write_timeout_s

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await super().write(data)
        except TimeoutError:
            log.warning(
                "request %s: the client took no bytes of its stream for %g s: disconnected, its choices aborted",
                request_id(self._client),
                self.write_timeout_s,
            )
            transport = self._client.transport
            if transport is not None:
                transport.abort()
            raise ClientStalled(f"no bytes taken for {self.write_timeout_s:g} s") from None


async def sse_response(request: web.Request, write_timeout_s: float | None = None) -> ClientStream:
    """The client's stream, its headers sent; a client that takes none of it for `write_timeout_s` is cut off."""
    out = ClientStream(request, write_timeout_s)
    await out.prepare(request)
    return out


async def read_chunk(resp: aiohttp.ClientResponse, stall_s: float | None = None) -> bytes:
    """The next bytes of `resp`; UpstreamLost when it fails, ends, or (with `stall_s`) sends nothing that long."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        chunk = await asyncio.wait_for(resp.content.readany(), stall_s)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        stalled = stall_s is not None and isinstance(e, asyncio.TimeoutError) and loop.time() - start >= stall_s
        raise lost("decode", e, stalled=stalled) from e
    if not chunk:
        raise lost("decode", None)
    return chunk


async def relay(out: web.StreamResponse, first: bytes, resp: aiohttp.ClientResponse) -> None:
    """Pass `resp`'s events on as they come, up to its [DONE]; raises UpstreamLost if that never comes."""
    buf = first
    while True:
        end = buf.rfind(b"\n\n") + 2
        if end >= 2:
            complete, buf = buf[:end], buf[end:]
            await out.write(complete)
            if complete.endswith(DONE):
                return
        buf += await read_chunk(resp)


async def choice_events(
    first: bytes, resp: aiohttp.ClientResponse, stall_s: float | None = None
) -> AsyncIterator[dict]:
    """The JSON events of one upstream stream, up to its [DONE]; raises UpstreamLost if that never comes."""
    buf = first
    while True:
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            line = event.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return
            try:
                data = json.loads(line[6:])
            except ValueError:
                raise UpstreamLost("The decode instance sent an event that is not JSON; retry the request.") from None
            yield data
        buf += await read_chunk(resp, stall_s)
