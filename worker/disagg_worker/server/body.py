"""Reading a request body within a size limit (413 beyond it), for the workers and the router.

A body announced larger than the limit (Content-Length) is refused before a byte of it is read; a
chunked body is refused as soon as what has arrived passes the limit. Either way nothing beyond
the limit is ever held in memory.
"""

from __future__ import annotations

from aiohttp import web

from disagg_worker.server.errors import too_large


def check_length(request: web.BaseRequest, limit: int) -> None:
    """413 when the announced Content-Length is beyond `limit`."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to be larger than `limit` bytes."""
    check_length(request, limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
