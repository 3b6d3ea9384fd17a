"""The deltas of a request's several choices, interleaved as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from disagg_worker.server.frontend import Delta


async def merged(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """Interleave the deltas of several choices as they come."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncIterator[Delta]) -> None:
        try:
            async for d in s:
                await q.put((i, d))
            await q.put((i, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_ = len(tasks)
    try:
        while open_:
            i, item = await q.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
