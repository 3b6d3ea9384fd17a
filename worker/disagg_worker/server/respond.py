"""Answering a completions or chat request: each of its prompts' n choices, whole or streamed (SSE).

A chat has one prompt; a completions request one or a batch (`protocol.parse_completions`). Choice j of prompt i
is index i * n + j of the answer (as OpenAI and vLLM number them) and runs as its own engine request, exactly as
that prompt sent alone runs its choice j (a seeded one draws with seed + j). The usage counts each prompt's tokens
once and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from aiohttp import web

from disagg_worker.request.errors import APIError, internal_error
from disagg_worker.request.messages import Route
from disagg_worker.request.params import SamplingParams
from disagg_worker.server import openai_format as fmt
from disagg_worker.server.echo import Echo
from disagg_worker.server.frontend import Delta, Frontend
from disagg_worker.server.interleave import merged
from disagg_worker.server.tool_calls import ChatTools, ToolStream, call_deltas

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRun:
    """One prompt of a request, tokenised and admitted, and what its choices echo (completions' `echo`)."""

    ids: list[int]
    params: SamplingParams
    echo: Echo | None = None


def logged_internal_error(request: web.Request) -> APIError:
    """Log the exception being handled under a fresh id; the client's message names the id only."""
    ref = uuid.uuid4().hex[:12]
    log.exception("internal error %s on %s %s", ref, request.method, request.path)
    return internal_error(ref)


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Choice i of n: a seeded request gets seed + i so the choices differ but stay reproducible."""
    if i == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + i)


def choice_streams(fe: Frontend, prompts: list[PromptRun], n: int, route: Route) -> list[AsyncIterator[Delta]]:
    """The deltas of every choice, in index order: prompt i's choice j is stream i * n + j."""
    return [fe.complete(p.ids, choice_params(p.params, j), route) for p in prompts for j in range(n)]


async def run_choices(fe: Frontend, prompts: list[PromptRun], n: int, route: Route) -> list[fmt.Choice]:
    streams = choice_streams(fe, prompts, n, route)
    choices = [fmt.Choice(i) for i in range(len(streams))]
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


async def respond(
    request: web.Request,
    fe: Frontend,
    model: str,
    prompts: list[PromptRun],
    n: int,
    route: Route,
    stream: bool,
    include_usage: bool,
    chat: bool,
    tools: ChatTools | None = None,
    token_ids: bool = False,
) -> web.StreamResponse:
    """Run each prompt's n choices and answer as a completion or chat completion, whole or streamed (SSE); with
    tools, a chat answer's calls are parsed out of its text (`tool_calls.py`)."""
    tok = fe.tokenizer
    rid = fmt.new_id("chatcmpl" if chat else "cmpl")
    prompt_tokens = sum(len(p.ids) for p in prompts)
    echoes = [p.echo for p in prompts for _ in range(n)]  # what choice i echoes (None: nothing)
    echo = echoes[0]  # a request echoes all its prompts or none
    if not stream:
        choices = await run_choices(fe, prompts, n, route)
        body = (fmt.chat_body if chat else fmt.completion_body)(rid, model, choices, tok, prompt_tokens)
        if tools is not None:
            body["choices"] = [tools.answer(c) for c in body["choices"]]
        if echo is not None:
            answers = zip(echoes, body["choices"], choices, strict=True)
            body["choices"] = [e.whole(tok, answer, c) if e is not None else answer for e, answer, c in answers]
            echo.usage(body)
        if token_ids:
            for c, answer in zip(choices, body["choices"], strict=True):
                answer["token_ids"] = c.token_ids
        return web.json_response(body)
    for p in prompts:
        fe.check_resume(route, p.params)  # a 400, before the stream's 200
    resp = await sse_response(request)
    choices = [fmt.Choice(i) for i in range(len(echoes))]
    calls = [tools.stream() for _ in choices] if tools is not None else None
    # A migrated request's stream goes on from where the client is: its role came with the first stream.
    started: set[int] = set(range(len(choices))) if route.resume else set()
    async with ends_stream(request, resp):
        async for i, d in merged(choice_streams(fe, prompts, n, route)):
            if chat:  # the role comes with the first token: a stream's first event is output or an error
                shown = d if calls is None else tool_delta(calls[i], d)
                chunk = fmt.chat_chunk(rid, model, i, shown, tok, first=i not in started)
                if calls is not None and d.finish_reason is not None:
                    end_with_calls(chunk, calls[i])
            else:
                e = echoes[i]
                # A migrated stream's text goes on after what the client has (`resume_chars`).
                offset = route.resume_chars + len(choices[i].text) + (len(e.prompt_text) if e is not None else 0)
                chunk = fmt.completion_chunk(rid, model, i, d, tok, offset)
                if e is not None and i not in started:
                    e.first_chunk(tok, chunk["choices"][0], d)
            if token_ids:
                chunk["choices"][0]["token_ids"] = d.token_ids
            await send_event(resp, chunk)
            started.add(i)
            choices[i].add(d)
        if include_usage:
            obj = "chat.completion.chunk" if chat else "text_completion"
            last = fmt.usage_chunk(rid, model, obj, choices, prompt_tokens)
            if echo is not None:
                echo.usage(last)
            await send_event(resp, last)
    return resp


def tool_delta(calls: ToolStream, d: Delta) -> Delta:
    """`d` with the text a possible tool call holds back taken out (and, at the end, what it released)."""
    text = calls.push(d.text)
    if d.finish_reason is not None:
        text += calls.finish(d.finish_reason)
    return replace(d, text=text)


def end_with_calls(chunk: dict, calls: ToolStream) -> None:
    """The last chunk of a choice carries its parsed calls, whole, and finish_reason "tool_calls"."""
    if calls.found:
        choice = chunk["choices"][0]
        choice["delta"]["tool_calls"] = call_deltas(calls.found)
        choice["finish_reason"] = "tool_calls"
