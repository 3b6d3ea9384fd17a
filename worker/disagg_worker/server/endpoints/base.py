"""What every OpenAI endpoint of a worker shares: running a request's choices, answering whole or streamed (SSE),
the usage, and failures turned into OpenAI errors. What an answer looks like is the endpoint's (`AnswerFormat`:
`completions.py`, `chat.py`), handed to `respond` per request.

A chat has one prompt; a completions request one or a batch (`protocol.parse_completions`). Choice j of prompt i
is index i * n + j of the answer (as OpenAI and vLLM number them) and runs as its own engine request, exactly as
that prompt sent alone runs its choice j (a seeded one draws with seed + j). The usage counts each prompt's tokens
once and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from aiohttp import web

from disagg_worker.http.admission import body_of
from disagg_worker.http.errors import logged_internal_error
from disagg_worker.request.errors import APIError
from disagg_worker.request.messages import Route
from disagg_worker.request.params import SamplingParams
from disagg_worker.server.frontend import Delta, Frontend
from disagg_worker.server.interleave import merged
from disagg_worker.server.protocol import parse_json

# How an endpoint finds the app's frontend when a request comes.
FrontendOf = Callable[[web.Request], Frontend]


@dataclass
class Choice:
    """Accumulated output of one choice (non-streaming responses and usage)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    def add(self, d: Delta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.top_logprobs += d.top_logprobs
        self.finish_reason = d.finish_reason or self.finish_reason
        self.prompt_tokens = d.prompt_tokens or self.prompt_tokens
        self.completion_tokens = d.completion_tokens
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)


@dataclass(frozen=True)
class PromptRun:
    """One prompt of a request, tokenised and admitted."""

    ids: list[int]
    params: SamplingParams


class AnswerFormat(Protocol):
    """What one endpoint's answer looks like (its object names, its choices' fields, what it adds to them);
    `respond` runs the choices and sends what this writes. Made per request: it may keep each streamed
    choice's state (a chat's held-back tool call)."""

    def body(self, choices: list[Choice], prompt_tokens: int) -> dict:
        """The whole answer of a request whose choices have all finished."""
        ...

    def chunk(self, index: int, d: Delta, sent: Choice, first: bool) -> dict:
        """The streamed chunk of choice `index` carrying `d`; `sent`: what the choice streamed before it;
        `first`: the client has nothing of this choice yet (a migrated stream's first chunk is not)."""
        ...

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict:
        """A stream's last chunk, with the usage (`stream_options.include_usage`)."""
        ...


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion = sum(c.completion_tokens for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def usage_chunk(rid: str, model: str, obj: str, choices: list[Choice], prompt_tokens: int) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(choices, prompt_tokens),
    }


async def read_json(fe: Frontend, request: web.Request):
    """The request's body (as the admission read it), parsed."""
    return await fe.parse(body_of(request), parse_json)


def wants_token_ids(body: dict) -> bool:
    """vLLM's `return_token_ids`: each choice (and each streamed chunk) carries its token ids."""
    value = body.get("return_token_ids", False)
    if not isinstance(value, bool):
        raise APIError(400, "return_token_ids must be a boolean", param="return_token_ids")
    return value


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: a seeded request gets seed + i so the choices differ but stay reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + i)


def choice_streams(fe: Frontend, prompts: list[PromptRun], n: int, route: Route) -> list[AsyncIterator[Delta]]:
    """The deltas of every choice, in index order: prompt i's choice j is stream i * n + j."""
    return [fe.complete(p.ids, choice_params(p.params, j), route) for p in prompts for j in range(n)]


async def run_choices(fe: Frontend, prompts: list[PromptRun], n: int, route: Route) -> list[Choice]:
    streams = choice_streams(fe, prompts, n, route)
    choices = [Choice(i) for i in range(len(streams))]
    async for i, d in merged(streams):
        choices[i].add(d)
    return choices


async def sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, data) -> None:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    await resp.write(f"data: {payload}\n\n".encode())


@asynccontextmanager
async def ends_stream(request: web.Request, resp: web.StreamResponse) -> AsyncIterator[None]:
    """A stream always ends with [DONE]; a failure inside it comes first, as an OpenAI error event."""
    try:
        yield
    except APIError as e:
        await send_event(resp, e.body())
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client left: nobody reads the rest
    except Exception:
        await send_event(resp, logged_internal_error(request).body())
    await send_event(resp, "[DONE]")


@dataclass(frozen=True)
class Delivery:
    """How the client takes its answer: streamed (with the usage at the end, if asked), and with vLLM's
    `return_token_ids` each choice (each chunk) with its token ids."""

    stream: bool
    include_usage: bool
    token_ids: bool


async def respond(
    request: web.Request,
    fe: Frontend,
    answer: AnswerFormat,
    prompts: list[PromptRun],
    n: int,
    route: Route,
    delivery: Delivery,
) -> web.StreamResponse:
    """Run each prompt's n choices and answer in `answer`'s format, whole or streamed (SSE)."""
    prompt_tokens = sum(len(p.ids) for p in prompts)
    if not delivery.stream:
        choices = await run_choices(fe, prompts, n, route)
        body = answer.body(choices, prompt_tokens)
        if delivery.token_ids:
            for c, shown in zip(choices, body["choices"], strict=True):
                shown["token_ids"] = c.token_ids
        return web.json_response(body)
    for p in prompts:
        fe.check_route(route, p.params)  # a 400, before the stream's 200
    resp = await sse_response(request)
    choices = [Choice(i) for i in range(len(prompts) * n)]
    # A migrated request's stream goes on from where the client is: its start came with the first stream.
    started: set[int] = set(range(len(choices))) if route.resume else set()
    async with ends_stream(request, resp):
        async for i, d in merged(choice_streams(fe, prompts, n, route)):
            chunk = answer.chunk(i, d, choices[i], first=i not in started)
            if delivery.token_ids:
                chunk["choices"][0]["token_ids"] = d.token_ids
            await send_event(resp, chunk)
            started.add(i)
            choices[i].add(d)
        if delivery.include_usage:
            await send_event(resp, answer.usage_chunk(choices, prompt_tokens))
    return resp
