"""Migration: a stream whose decode fails goes on on another pair, and its client sees one unbroken answer.

The router asks the workers for each streamed chunk's token ids (`return_token_ids`, stripped again unless the
client asked for them too) and keeps, per choice, the ids sent so far and how many characters of text the
client got. When the decode serving the choice fails (the connection drops or the stream ends before [DONE],
no event comes within `stall_s`, or an error event that is not the request's own), the router re-issues the
choice to another pair, the failed decode left out: the same body plus `resume_token_ids` and
`resume_text_chars` (`request/route.py`). The new pair goes on from there (`server/frontend.py`): the prompt is
extended by those ids (never by re-tokenised text), max_tokens counts them, a seeded request's generator and a
structured output's grammar are moved past them (`engine/sampling.py`), and the usage counts each token once.
The client's stream continues with the next token, under the first response's id. Each choice migrates at most
`limit` times, and for a stall once (`stall.py`); the next failure ends it with an error event, as a stream ends
without migration. Each event stamps its decode's `last_event`; when a stream stalls, a decode silent on all its
streams is held out of rotation (`stall.judge`) before the stream migrates, so the stream and new requests avoid it.

A failure the request caused (`internal_error`) or one that took the instance down while it held the request
(`instance_failed`) is not migrated: the request could do the same to the next instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from disagg_worker.request import route
from disagg_worker.request.errors import NOT_RETRIED
from disagg_worker.router.app import Router
from disagg_worker.router.attempt import Opened
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.stall import STALL, judge, may_migrate
from disagg_worker.router.stream import UpstreamLost, choice_events

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What the client has of one choice: its token ids, the characters of its text, whether it finished."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0
    finished: bool = False
    migrations: int = 0
    stalls: int = 0

    def note(self, event: dict) -> None:
        for c in event.get("choices", []):
            self.token_ids += c.get("token_ids") or []
            delta = c.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else c.get("text")
            self.chars += len(text) if isinstance(text, str) else 0
            self.finished = self.finished or c.get("finish_reason") is not None


def failure_of(event: dict) -> UpstreamLost | None:
    """An error event that another pair may not repeat, as a lost stream; None for any other event."""
    error = event.get("error")
    if event.get("choices") or not isinstance(error, dict):
        return None
    if error.get("type") != "server_error" or error.get("code") in NOT_RETRIED:
        return None
    return UpstreamLost(str(error.get("message", "the decode instance failed")), "error_event")


class MigratingChoice:
    """The events of one streamed choice, across the pairs it migrates to; `close` gives back the last one."""

    def __init__(
        self,
        router: Router,
        path: str,
        body: SharedBody,
        choice: dict[str, Any],
        opened: Opened,
        prompt: Prompt | None = None,
    ):
        self.router, self.path, self.body, self.choice, self.prompt = router, path, body, choice, prompt
        self.opened: Opened | None = opened
        self.progress = Progress()
        self.client_ids = body.fields.get("return_token_ids") is True
        self.response_id: str | None = None

    async def events(self) -> AsyncIterator[dict]:
        """The choice's JSON events up to its [DONE]; UpstreamLost once it cannot migrate any more."""
        while True:
            o = self.opened
            if o is None:
                return
            try:
                async for event in choice_events(o.first, o.resp, self.router.stall_s):
                    o.decode.last_event = time.monotonic()
                    lost = failure_of(event)
                    if lost is not None:
                        raise lost
                    self.progress.note(event)
                    yield self._as_sent(event)
                return
            except UpstreamLost as e:
                if e.cause == STALL:  # before it migrates: a stalled decode is left out of the next pick
                    self._judge(o)
                if self.progress.finished:  # every token arrived: only the end of the stream was lost
                    return
                p, limit = self.progress, self.router.migration_limit
                if p.migrations >= limit or not may_migrate(e.cause, p.stalls) or self.router.cut_reason:
                    raise
                if self.progress.chars and not self.progress.token_ids:  # a worker that sends no token ids (an
                    raise  # older revision): a resume would repeat the answer from its start
                await self._migrate(o, e)

    def _judge(self, o: Opened) -> None:
        """The stream from `o.decode` stalled: hold the decode out if it stalled as a whole (`stall.py`)."""
        self.progress.stalls += 1
        r = self.router
        v = judge(o.decode, time.monotonic(), r.stall_s or 0.0, r.stall_hold_s)
        r.pool.stalls[v.value] += 1

    async def _migrate(self, o: Opened, e: UpstreamLost) -> None:
        failed, p = o.decode, self.progress
        self.router.pool.migrations[e.cause] += 1
        self.close(f"migrated: {e.message}")
        p.migrations += 1
        resume = route.resume_fields(p.token_ids, p.chars)
        opened = await self.router.open(self.path, self.body, {**self.choice, **resume}, self.prompt, {failed})
        self.opened = opened
        log.info(
            "%s: migrated from decode %s (%s) after %d tokens to decode %s (migration %d of at most %d)",
            self.response_id or "a stream",
            failed.url,
            e.cause,
            len(p.token_ids),
            opened.decode.url,
            p.migrations,
            self.router.migration_limit,
        )

    def _as_sent(self, event: dict) -> dict:
        """The event as the client gets it: the first response's id, token ids only if it asked for them."""
        if "id" in event:
            self.response_id = self.response_id or event["id"]
            event["id"] = self.response_id
        if not self.client_ids:
            for c in event.get("choices", []):
                c.pop("token_ids", None)
        return event

    def close(self, error: str = "") -> None:
        """Give the current pair's stream back (once); `error`: its decode failed."""
        if self.opened is not None:
            self.router.close(self.opened, error)
            self.opened = None

    def cancel(self) -> None:
        """The client left: abort the prefill side too."""
        if self.opened is not None and self.opened.prefill is not None:
            self.opened.prefill.cancel()


def migrates(router: Router, path: str, body: SharedBody) -> bool:
    """Whether a request's streams migrate: OpenAI's streamed completions and chat, with a limit above 0."""
    streamed = body.fields.get("stream") is True and body.fields.get("echo") is not True  # a resumed echo repeats
    return router.migration_limit > 0 and streamed and path in ("/v1/completions", "/v1/chat/completions")


def with_token_ids(router: Router, path: str, body: SharedBody, choice: dict[str, Any]) -> dict[str, Any]:
    """The choice's fields, asking the worker for token ids when its stream may migrate."""
    return {**choice, "return_token_ids": True} if migrates(router, path, body) else choice
