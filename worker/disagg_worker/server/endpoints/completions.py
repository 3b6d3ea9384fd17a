"""`POST /v1/completions`: one prompt or a batch of them, text (or token ids) in, `text_completion` objects out,
whole or streamed, over the shared base (`base.py`). What is the endpoint's own: the choices' text offsets and
logprobs, and `echo`.

`echo`: the answer starts with the prompt, and with `logprobs` the prompt's tokens come with theirs as vLLM
returns them: the first prompt token's logprob is null (nothing precedes it), each other's is its
log-probability given the tokens before it (`engine/prompt_logprobs.py`), its top-N alternatives beside it.
With `max_tokens: 0` the prompt is the whole answer (the one token the engine generates is dropped). Such an
answer holds prompt tokens x (logprobs + 1) x n entries, bounded per request (`request/limits.py`).

Through P/D the prompt is computed by prefill: decode's answer carries the prompt's tokens with null logprobs,
which the router fills in from prefill's answer (`router/echo.py`).
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from aiohttp import web

from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.request.limits import check_echo_logprobs
from disagg_worker.request.route import route_of
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
from disagg_worker.server.frontend import Delta, Frontend
from disagg_worker.server.protocol import CompletionRequest, parse_completions


def add_completion_route(
    app: web.Application, frontend: FrontendOf, model: str, adapters: Collection[str] = ()
) -> None:
    """POST /v1/completions of `model` and of its LoRA `adapters` (an answer names the one asked for)."""

    async def completions(request: web.Request) -> web.StreamResponse:
        fe = frontend(request)
        body = await read_json(fe, request)
        reqs = parse_completions(body, model, fe.limits, adapters)
        runs = [await prompt_run(fe, req) for req in reqs]
        req = reqs[0]  # the fields besides the prompt are every prompt's
        if req.echo:
            check_echo_logprobs(sum(len(run.ids) for run, _ in runs), req.sampling.logprobs, req.n)
        route = route_of(body)
        delivery = Delivery(req.stream, req.stream_options_include_usage, wants_token_ids(body))
        echoes = [echo for _, echo in runs for _ in range(req.n)]  # what choice i echoes (None: nothing)
        answer = CompletionFormat(req.model, fe.tokenizer, echoes, route.resume_chars)
        return await respond(request, fe, answer, [run for run, _ in runs], req.n, route, delivery)

    app.router.add_post("/v1/completions", completions)


async def prompt_run(fe: Frontend, req: CompletionRequest) -> tuple[PromptRun, Echo | None]:
    """One prompt tokenised and admitted (a token prompt was, while parsing), with what its choices echo."""
    if isinstance(req.prompt, list):
        ids, params = req.prompt, req.sampling
    else:
        ids = await fe.encode(req.prompt)
        params = fe.limits.admit(ids, req.sampling, req.max_tokens_set, prompt_param=req.param)
    shown = prompt_text(fe.tokenizer, req.prompt)
    echo = Echo(ids, shown, req.echo_only, params.logprobs is not None) if req.echo else None
    return PromptRun(ids, params), echo


class CompletionFormat:
    """`text_completion` answers (an `AnswerFormat`); choice i echoes `echoes[i]` (a request echoes all its
    prompts or none). A migrated stream's text goes on after the `resume_chars` the client has."""

    def __init__(self, model: str, tok: Tokenizer, echoes: list[Echo | None], resume_chars: int = 0):
        self.rid = new_id("cmpl")
        self.model, self.tok, self.echoes, self.resume_chars = model, tok, echoes, resume_chars
        self.echo = echoes[0]

    def body(self, choices: list[Choice], prompt_tokens: int) -> dict:
        body = completion_body(self.rid, self.model, choices, self.tok, prompt_tokens)
        if self.echo is not None:
            answers = zip(self.echoes, body["choices"], choices, strict=True)
            body["choices"] = [e.whole(self.tok, answer, c) if e is not None else answer for e, answer, c in answers]
            self.echo.usage(body)
        return body

    def chunk(self, index: int, d: Delta, sent: Choice, first: bool) -> dict:
        e = self.echoes[index]
        offset = self.resume_chars + len(sent.text) + (len(e.prompt_text) if e is not None else 0)
        chunk = completion_chunk(self.rid, self.model, index, d, self.tok, offset)
        if e is not None and first:
            e.first_chunk(self.tok, chunk["choices"][0], d)
        return chunk

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict:
        last = usage_chunk(self.rid, self.model, "text_completion", choices, prompt_tokens)
        if self.echo is not None:
            self.echo.usage(last)
        return last


def completion_logprobs(tok: Tokenizer, ids: list[int], lps: list[float], tops: list, offset: int) -> dict | None:
    if not lps:
        return None
    tokens = [tok.decode([i], skip_special_tokens=False) for i in ids[: len(lps)]]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{tok.decode([i], skip_special_tokens=False): lp for i, lp in top} for top in tops]
        if tops
        else None,
        "text_offset": offsets,
    }


def completion_body(rid: str, model: str, choices: list[Choice], tok: Tokenizer, prompt_tokens: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(tok, c.token_ids, c.logprobs, c.top_logprobs, 0),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage(choices, prompt_tokens),
    }


def completion_chunk(rid: str, model: str, index: int, d: Delta, tok: Tokenizer, offset: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": index,
                "text": d.text,
                "logprobs": completion_logprobs(tok, d.token_ids, d.logprobs, d.top_logprobs, offset),
                "finish_reason": d.finish_reason,
            }
        ],
    }


@dataclass(frozen=True)
class Echo:
    prompt_ids: list[int]
    prompt_text: str  # the prompt as the client sent it (or its tokens' text)
    only: bool  # max_tokens 0: the prompt is the answer
    logprobs: bool  # the request asked for logprobs

    def prompt_part(self, tok: Tokenizer, lps: list[float] | None, tops: list | None) -> dict:
        """The prompt's logprobs entries (tokens, token_logprobs, top_logprobs, text_offset)."""
        n = len(self.prompt_ids) - 1
        scores: list[float | None] = [None, *(lps if lps is not None and len(lps) == n else [None] * n)]
        named = [{tok.decode([i], skip_special_tokens=False): lp for i, lp in top} for top in (tops or [])]
        part = completion_logprobs(tok, self.prompt_ids, [0.0] * len(self.prompt_ids), [], 0) or {}
        wanted_tops = tops is not None and any(tops)
        part["token_logprobs"] = scores
        part["top_logprobs"] = [None, *named] if wanted_tops and len(named) == n else [None] * len(scores)
        return part

    def whole(self, tok: Tokenizer, choice: dict, c: Choice) -> dict:
        """A whole completion choice with the prompt in front."""
        prompt = self.prompt_text
        text = "" if self.only else choice["text"]
        out = {**choice, "text": prompt + text}
        if self.only:
            out["finish_reason"] = "length"
        if self.logprobs:  # the answer's offsets count from its own start: shifted past the prompt
            out["logprobs"] = self._joined(
                tok, c.prompt_logprobs, c.prompt_top_logprobs, choice["logprobs"], len(prompt)
            )
        return out

    def first_chunk(self, tok: Tokenizer, choice: dict, d: Delta) -> None:
        """The first streamed chunk of a choice: the prompt (and its logprobs) comes before the first text."""
        prompt = self.prompt_text
        if self.only:
            choice["text"], choice["logprobs"], choice["finish_reason"] = "", None, "length"
        choice["text"] = prompt + choice["text"]
        if self.logprobs:  # a chunk's offsets already count the echoed prompt (`CompletionFormat.chunk`)
            choice["logprobs"] = self._joined(tok, d.prompt_logprobs, d.prompt_top_logprobs, choice["logprobs"], 0)

    def _joined(self, tok: Tokenizer, lps, tops, generated: dict | None, shift: int) -> dict:
        """The prompt's logprobs entries, then the answer's (its text offsets moved by `shift`)."""
        part = self.prompt_part(tok, lps, tops)
        if self.only or not generated:
            return part
        for key in ("tokens", "token_logprobs"):
            part[key] += generated[key]
        part["top_logprobs"] += generated["top_logprobs"] or [None] * len(generated["tokens"])
        part["text_offset"] += [o + shift for o in generated["text_offset"]]
        return part

    def usage(self, body: dict) -> None:
        """With max_tokens 0 nothing is generated: the usage says so."""
        if self.only and "usage" in body:
            u = body["usage"]
            u["completion_tokens"], u["total_tokens"] = 0, u["prompt_tokens"]


def prompt_text(tok: Tokenizer, prompt: str | list[int]) -> str:
    """What echo shows of a prompt: the text sent, or a token prompt's text."""
    return prompt if isinstance(prompt, str) else tok.decode(prompt, skip_special_tokens=False)
