"""What one pair answered: an error before anything reached the client (`Attempt`), or a decode stream that
started (`Opened`)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from disagg_worker.http.admission import RETRY_AFTER_S
from disagg_worker.request.errors import NOT_RETRIED, APIError
from disagg_worker.router.hops import NO_HOP, Hop
from disagg_worker.router.worker import Worker


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
