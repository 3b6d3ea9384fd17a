"""A request body serialised once and sent to every worker of every choice without a copy.

The router sends each choice of a request to a prefill and a decode instance, each with its own
bootstrap room (and `n = 1`, its own seed). `SharedBody` serialises everything but those few
per-request fields once; each upstream request is a small JSON head with its own fields followed
by the shared bytes, written straight from one buffer (`JoinedPayload`). However large the prompt
and however many choices, one serialised copy of it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp.abc import AbstractStreamWriter
from aiohttp.payload import Payload

from disagg_worker.request import route

# Fields the router sets per upstream request; never part of the shared bytes.
# `echo` and `logprobs` are read by the router (`echo.py`), not changed.
PER_REQUEST = ("n", "seed", "stream", "stream_options", "return_token_ids", "echo", "logprobs")
# Writes of the shared bytes go out in slices, so the transport never buffers a whole copy at once.
WRITE_SLICE = 256 * 1024


def _dumps(value: Any) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: escape it and let the worker name the field
        return json.dumps(value, separators=(",", ":")).encode()


@dataclass(frozen=True)
class SharedBody:
    # The body without PER_REQUEST fields, serialised, without its opening brace.
    tail: bytes
    # The client's own values of PER_REQUEST fields.
    fields: dict[str, Any]
    # The body's `model` ("" when it names none, or not as text): the pool pairs by its LoRA adapter.
    model: str = ""

    @classmethod
    def of(cls, body: dict[str, Any]) -> SharedBody:
        rest = {k: v for k, v in body.items() if k not in PER_REQUEST and k not in route.FIELDS}
        model = body.get("model")
        fields = {k: body[k] for k in PER_REQUEST if k in body}
        return cls(_dumps(rest)[1:], fields, model if isinstance(model, str) else "")

    def payload(self, **fields: Any) -> JoinedPayload:
        """The body with `fields` set (over the client's), as one upstream request's payload."""
        head = _dumps({**self.fields, **fields})[:-1]
        if head != b"{" and self.tail != b"}":
            head += b","
        return JoinedPayload(head, self.tail)


class JoinedPayload(Payload):
    """`head` then `shared`, never joined into one buffer: every choice's payload shares `shared`."""

    def __init__(self, head: bytes, shared: bytes):
        super().__init__(shared, content_type="application/json")
        self._head = head
        self._total = len(head) + len(shared)
        self._size = self._total

    @property
    def shared(self) -> bytes:
        return self._value

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return (self._head + self._value).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: int | None) -> None:
        left = self._total if content_length is None else min(content_length, self._total)
        for part in (memoryview(self._head), memoryview(self._value)):
            for start in range(0, len(part), WRITE_SLICE):
                if left <= 0:
                    return
                piece = part[start : start + min(WRITE_SLICE, left)]
                await writer.write(piece)
                left -= len(piece)
