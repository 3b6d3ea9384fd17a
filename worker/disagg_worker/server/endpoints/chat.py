"""`POST /v1/chat/completions`: a chat in, `chat.completion` objects (or `chat.completion.chunk` events) out, over
the shared base (`base.py`). What is the endpoint's own: the assistant's role (with a stream's first chunk of a
choice), chat logprobs, and tools: the request's calls parsed out of the answer (`tool_calls.py`), whole or,
streamed, held back as they are written and sent whole in the choice's last chunk (`tool_calls` deltas, finish
reason "tool_calls"). The prompt is read, rendered and admitted as the Responses API reads it (`chat_input.py`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import replace

from aiohttp import web

from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.request.route import route_of
from disagg_worker.server.chat_input import chat_input
from disagg_worker.server.endpoints.base import (
    Choice,
    Delivery,
    FrontendOf,
    PromptRun,
    new_id,
    read_json,
    respond,
    usage,
    usage_chunk,
    wants_token_ids,
)
from disagg_worker.server.frontend import Delta
from disagg_worker.server.protocol import parse_chat
from disagg_worker.server.tool_calls import ChatTools, ToolStream, call_deltas


def add_chat_route(app: web.Application, frontend: FrontendOf, model: str, adapters: Collection[str] = ()) -> None:
    """POST /v1/chat/completions of `model` and of its LoRA `adapters` (an answer names the one asked for)."""

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        fe = frontend(request)
        body = await read_json(fe, request)
        req = parse_chat(body, model, fe.limits, adapters)
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        ids, params, tools = await chat_input(fe, req, key)
        route = route_of(body)
        delivery = Delivery(req.stream, req.stream_options_include_usage, wants_token_ids(body))
        answer = ChatFormat(req.model, fe.tokenizer, tools)
        return await respond(request, fe, answer, [PromptRun(ids, params)], req.n, route, delivery)

    app.router.add_post("/v1/chat/completions", chat_completions)


class ChatFormat:
    """`chat.completion` answers (an `AnswerFormat`); with `tools`, each choice's calls parsed out of its text,
    a streamed choice's by its own `ToolStream`."""

    def __init__(self, model: str, tok: Tokenizer, tools: ChatTools | None = None):
        self.rid = new_id("chatcmpl")
        self.model, self.tok, self.tools = model, tok, tools
        self.calls: dict[int, ToolStream] = {}  # each streamed choice's calls, held back until it ends

    def body(self, choices: list[Choice], prompt_tokens: int) -> dict:
        body = chat_body(self.rid, self.model, choices, self.tok, prompt_tokens)
        if self.tools is not None:
            body["choices"] = [self.tools.answer(c) for c in body["choices"]]
        return body

    def chunk(self, index: int, d: Delta, sent: Choice, first: bool) -> dict:
        # The role comes with the first token: a stream's first event is output or an error.
        if self.tools is None:
            return chat_chunk(self.rid, self.model, index, d, self.tok, first)
        if index not in self.calls:
            self.calls[index] = self.tools.stream()
        calls = self.calls[index]
        chunk = chat_chunk(self.rid, self.model, index, tool_delta(calls, d), self.tok, first)
        if d.finish_reason is not None:
            end_with_calls(chunk, calls)
        return chunk

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict:
        return usage_chunk(self.rid, self.model, "chat.completion.chunk", choices, prompt_tokens)


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


def chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: list) -> dict | None:
    if not lps:
        return None

    def entry(i: int, lp: float) -> dict:
        s = tok.decode([i], skip_special_tokens=False)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    content = []
    for k, (i, lp) in enumerate(zip(ids, lps, strict=True)):
        e = entry(i, lp)
        e["top_logprobs"] = [entry(t, tlp) for t, tlp in tops[k]] if tops and k < len(tops) else []
        content.append(e)
    return {"content": content}


def chat_body(rid: str, model: str, choices: list[Choice], tok: Tokenizer, prompt_tokens: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(tok, c.token_ids, c.logprobs, c.top_logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(choices, prompt_tokens),
    }


def chat_chunk(rid: str, model: str, index: int, d: Delta | None, tok: Tokenizer, first: bool) -> dict:
    delta: dict = {"role": "assistant", "content": ""} if first else {}
    if d is not None and d.text:
        delta["content"] = d.text
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs) if d is not None else None,
        "finish_reason": d.finish_reason if d is not None else None,
    }
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
