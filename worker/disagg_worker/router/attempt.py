"""What one pair answered: an error before anything reached the client (`Attempt`), or a decode stream that
started (`Opened`); and how decode's first answer is read into one or the other (`first_event`, `error_in`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from disagg_worker.http.admission import RETRY_AFTER_S
from disagg_worker.request.errors import NOT_RETRIED, STATUS_OF_CODE, APIError
from disagg_worker.router.hops import NO_HOP, Hop
from disagg_worker.router.stream import lost
from disagg_worker.router.worker import Worker

STATUS_OF_TYPE = {"invalid_request_error": 400, "not_found_error": 404}


@dataclass
class Attempt:
    """What one pair answered before anything reached the client; `worker` is the side that failed."""

    status: int
    body: dict
    worker: Worker | None = None

    @property
    def retryable(self) -> bool:
        """A failure another pair may not repeat: not a request's own error, nor one that took its instance down."""
        return (self.status >= 500 and self.code not in NOT_RETRIED) or self.status == 429

    @property
    def code(self) -> str | None:
        return self.body.get("error", {}).get("code")

    def error(self) -> APIError:
        e = self.body.get("error", {})
        retry_after = RETRY_AFTER_S if self.status in (429, 503) else None
        return APIError(
            self.status,
            e.get("message", "request failed"),
            type=e.get("type", "server_error"),
            param=e.get("param"),
            code=e.get("code"),
            retry_after=retry_after,
        )


@dataclass(eq=False)
class Opened:
    """A decode stream that started answering, and the prefill request beside it."""

    resp: aiohttp.ClientResponse
    first: bytes
    prefill: asyncio.Task | None  # None: decode computed the prompt itself
    decode: Worker
    decode_group: int | None = None
    hop: Hop = NO_HOP  # its spans (with tracing on and the request sampled)


def json_or_error(status: int, data: bytes) -> dict:
    try:
        body = json.loads(data)
        if isinstance(body, dict):
            return body
    except ValueError:
        pass
    return APIError(status, data.decode(errors="replace")[:500] or f"HTTP {status}", type="server_error").body()


async def first_event(resp: aiohttp.ClientResponse) -> bytes:
    """For a stream, read up to the end of the first SSE event; otherwise the whole body."""
    if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        return await resp.read()
    buf = b""
    while b"\n\n" not in buf:
        chunk = await resp.content.readany()
        if not chunk:
            break
        buf += chunk
    return buf


def error_in(status: int, first: bytes) -> Attempt | None:
    """The failure decode's status and first event say (None: the answer started)."""
    if status != 200:
        return Attempt(status, json_or_error(status, first))
    text = first.decode(errors="replace").strip()
    if not text:
        return Attempt(502, APIError(502, lost("decode", None).message, type="server_error").body())
    if text.startswith("data: "):
        try:
            event = json.loads(text[6:].split("\n\n")[0])
        except ValueError:
            return None
        if isinstance(event, dict) and "error" in event:
            error = event["error"]
            status = STATUS_OF_CODE.get(error.get("code")) or STATUS_OF_TYPE.get(error.get("type"), 500)
            return Attempt(status, event)
    return None
