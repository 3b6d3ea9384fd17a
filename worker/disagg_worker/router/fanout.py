"""The choices of an `n > 1` request or of a completions batch, each answered by its own pair, merged into one answer.

Choice k of the merged answer is the k-th single-choice request: prompt i's choice j is k = i * n + j, and the
`per_prompt` (n) consecutive choices of a prompt share its prompt tokens. Whole answers are merged into one body
(choices re-indexed, usage summed: each prompt's tokens once, every choice's completion tokens). Streams are
merged as their events come; every choice carries its own index and all share the first response id. A choice
whose upstream drops, times out or ends early ends with an error event naming it; the others go on, and the
merged stream always ends with the usage (when asked for) and [DONE].
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from disagg_worker.request.errors import APIError
from disagg_worker.router.stream import DONE, UPSTREAM_ERROR, UpstreamLost

# Events of one choice that may wait to be written to the client (`stream_merged`).
CHOICE_EVENTS = 64


def merge_bodies(bodies: list[dict], per_prompt: int) -> dict:
    merged = dict(bodies[0])
    merged["choices"] = []
    for i, b in enumerate(bodies):
        for c in b.get("choices", []):
            merged["choices"].append({**c, "index": i})
    usage = dict(bodies[0].get("usage") or {})
    if len(bodies) > per_prompt:  # a batch: the first choice of each prompt counts its tokens
        usage["prompt_tokens"] = sum((b.get("usage") or {}).get("prompt_tokens", 0) for b in bodies[::per_prompt])
    usage["completion_tokens"] = sum((b.get("usage") or {}).get("completion_tokens", 0) for b in bodies)
    usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
    merged["usage"] = usage
    return merged


def choice_error(i: int, message: str) -> dict:
    return APIError(502, f"Choice {i}: {message}", "server_error", code=UPSTREAM_ERROR).body()


class Merger:
    """Re-labels the events of each choice and sums the usage they report."""

    def __init__(self, per_prompt: int) -> None:
        self.per_prompt = per_prompt  # consecutive choices that share a prompt (n)
        self.id: str | None = None  # one response id for all choices: the first one seen
        self.usage: dict = {}
        self.prompt_tokens: dict[int, int] = {}  # per prompt: what the first of its choices to report says
        self.last_usage: dict | None = None

    def relabel(self, i: int, event: dict) -> dict | None:
        """The event as choice i of the merged stream; None for a usage event (summed, sent at the end)."""
        if "error" in event and not event.get("choices"):
            return choice_error(i, str(event["error"].get("message", "failed")))
        if "usage" in event and not event.get("choices"):
            self.prompt_tokens.setdefault(i // self.per_prompt, event["usage"].get("prompt_tokens", 0))
            self.usage["prompt_tokens"] = sum(self.prompt_tokens.values())
            self.usage["completion_tokens"] = self.usage.get("completion_tokens", 0) + event["usage"].get(
                "completion_tokens", 0
            )
            self.last_usage = event
            return None
        for c in event.get("choices", []):
            c["index"] = i
        if "id" in event:
            self.id = self.id or event["id"]
            event["id"] = self.id
        return event

    def usage_event(self) -> dict | None:
        if self.last_usage is None:
            return None
        usage = {**self.usage, "total_tokens": self.usage["prompt_tokens"] + self.usage["completion_tokens"]}
        return {
            **self.last_usage,
            "id": self.id or self.last_usage.get("id"),
            "usage": {**self.last_usage["usage"], **usage},
        }


async def stream_merged(
    out: web.StreamResponse,
    streams: list[AsyncIterator[dict]],
    per_prompt: int,
    cut_reason: Callable[[], str] = lambda: "",
) -> None:
    """Write the merged events of `streams` (one a choice, `per_prompt` a prompt) to `out`, ending with [DONE]
    whatever each choice does.

    `cut_reason()` names why the router closed the upstreams, if it did (a drain that timed out).

    Each choice may have at most `CHOICE_EVENTS` events waiting to be written: a client that reads slowly holds
    its choices' upstreams back, as it holds a single stream's, instead of having the router queue their answers
    without bound. One that reads nothing is disconnected once a write has waited for it longer than `out`
    allows (`ClientStream`): the write raises, every pump is cancelled, and the caller gives back (and so aborts)
    every choice's upstream."""
    queue: asyncio.Queue[tuple[int, dict | None]] = asyncio.Queue()
    credits = [asyncio.Semaphore(CHOICE_EVENTS) for _ in streams]
    merger = Merger(per_prompt)

    async def pump(i: int, events: AsyncIterator[dict]) -> None:
        try:
            async for event in events:
                relabelled = merger.relabel(i, event)
                if relabelled is not None:
                    await credits[i].acquire()  # returned once the event is written
                    queue.put_nowait((i, relabelled))
        except UpstreamLost as e:
            queue.put_nowait((-1, choice_error(i, cut_reason() or e.message)))
        except APIError as e:  # no pair took the choice's migration
            queue.put_nowait((-1, choice_error(i, e.message)))
        finally:
            queue.put_nowait((-1, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, event = await queue.get()
            if event is None:
                remaining -= 1
                continue
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
            if i >= 0:
                credits[i].release()
        usage = merger.usage_event()
        if usage is not None:
            await out.write(f"data: {json.dumps(usage)}\n\n".encode())
        await out.write(DONE)
    finally:
        for t in tasks:
            t.cancel()
