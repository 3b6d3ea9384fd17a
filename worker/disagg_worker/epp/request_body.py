"""A request's body as the endpoint picker reads it: gathered from the gateway's chunks within a bound of bytes
(`BodyBuffer`: beyond it, 413), checked by the workers' own parsers (`server/protocol.py`, the Responses API's
`server/responses_input.py`), so that a body a worker would refuse gets, from the gateway, the 4xx the router and
the worker give it (status, OpenAI error body naming the field), and the body cache_aware scores (a Responses
request as the chat request it runs as).

Pure: no gRPC, no pool. Limits that need the model (context length, vocabulary) are the worker's to check, as
the router leaves them to it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from disagg_worker.request.errors import too_large
from disagg_worker.request.limits import RequestLimits
from disagg_worker.server.protocol import parse_chat, parse_completions, parse_generate, parse_json
from disagg_worker.server.responses_input import input_items, parse_responses, to_chat_body

CHAT, COMPLETIONS, RESPONSES, GENERATE = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"
# The picker checks no limits that need the model (the workers do): any context length passes here.
_NO_LIMITS = RequestLimits(max_context_len=1 << 40)


class BodyBuffer:
    """The chunks of one request body, up to `limit` bytes (an `add` past it raises the 413)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            self.chunks = []  # nothing more of it is kept
            raise too_large(self.limit)
        self.chunks.append(chunk)

    def bytes(self) -> bytes:
        return b"".join(self.chunks)


def path_of(target: str) -> str:
    """The path of a request's `:path` (its query string dropped)."""
    return target.partition("?")[0]


# The paths whose bodies the picker reads, each with the parser its worker runs on it (with the LoRA adapters a
# request may name: chat and completions take them, as the workers do); any other request is picked by load alone.
CHECKS: dict[str, Callable[[Any, str, Collection[str]], object]] = {
    CHAT: lambda body, model, adapters: parse_chat(body, model, _NO_LIMITS, adapters),
    COMPLETIONS: lambda body, model, adapters: parse_completions(body, model, _NO_LIMITS, adapters),
    GENERATE: lambda body, model, adapters: parse_generate(body, _NO_LIMITS),
    RESPONSES: lambda body, model, adapters: parse_responses(body, input_items(body), model, _NO_LIMITS),
}

# The paths a decode hands off when a request names its prefill (`router/decode_handoff.py`; the Responses API it
# refuses with a 400 saying why): in P/D mode the picker names a prefill for these alone.
HANDED_OFF = frozenset({CHAT, COMPLETIONS, GENERATE, RESPONSES})


def read_request(path: str, raw: bytes, model: str, adapters: Collection[str] = ()) -> dict[str, Any]:
    """The body of a request to `path` (one of `CHECKS`) once its worker's parser accepts it; the parser's
    `APIError` (400 naming the field, 404 for another model than `model` or one of `adapters`) otherwise."""
    body = parse_json(raw)
    CHECKS[path](body, model, adapters)
    return body


def adapter_of(path: str, body: dict[str, Any], model: str) -> str:
    """The LoRA adapter a request read by `read_request` runs under ("": the base model)."""
    named = body.get("model") if path in (CHAT, COMPLETIONS) else None
    return named if isinstance(named, str) and named != model else ""


def scored(path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The path and body cache_aware scores (`router/prompt.py` reads chat, completions and /generate): a
    Responses request as its chat request (its own input; an earlier turn it continues is not known here)."""
    if path == RESPONSES:
        return CHAT, to_chat_body(body, input_items(body))
    return path, body
