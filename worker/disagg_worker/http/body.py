"""Reading a request body within a size limit (413 beyond it) and a time limit (408), for the workers and
the router.

A body announced larger than the limit (Content-Length) is refused before a byte of it is read; a
chunked body is refused as soon as what has arrived passes the limit. Either way nothing beyond
the limit is ever held in memory. `take(n)` hears of every chunk before it is kept (the admission's
budget of body bytes held at once, which refuses past it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from disagg_worker.request.errors import APIError, too_large

# The longest a client may take to send its body. A body is read before the request takes an admission slot,
# so a slow upload holds no slot; the limit ends it instead of letting it hold its connection and bytes for ever.
BODY_READ_TIMEOUT_S = 60.0


def check_length(request: web.BaseRequest, limit: int) -> None:
    """413 when the announced Content-Length is beyond `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


async def read_body(
    request: web.BaseRequest,
    limit: int,
    take: Callable[[int], None] = lambda n: None,
    timeout_s: float = BODY_READ_TIMEOUT_S,
) -> bytes:
    """The whole body; a 413 as soon as it is known to be larger than `limit` bytes, a 408 when it has not
    arrived within `timeout_s`."""
    check_length(request, limit)
    chunks: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            take(len(chunk))
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        message = f"The request body did not arrive within {timeout_s:g} s; send it at once."
        raise APIError(408, message, code="request_timeout") from None
    return b"".join(chunks)
