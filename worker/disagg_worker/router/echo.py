"""Completions' `echo` with `logprobs` through P/D: the prompt's logprobs come from prefill.

Prefill computes the prompt, so its answer (the router reads it whole) holds the prompt's tokens with their
logprobs (`server/endpoints/completions.py`); decode's holds the same tokens with null logprobs, since it
received the prompt's KV without computing it. The router puts prefill's values into decode's answer, or into
the first event of decode's stream, before the client sees it. Such a stream does not migrate (a resumed stream would
echo the prompt again).

So the router holds every choice's prompt logprobs at once: `check_echo_bound` refuses, before any worker sees
the request, one whose answer would hold more of them than one request may (`request/limits.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from disagg_worker.request.limits import check_echo_logprobs
from disagg_worker.router.attempt import Opened
from disagg_worker.router.batch import valid_n
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.prompt import PromptTokens
from disagg_worker.server.protocol import split_prompts

log = logging.getLogger(__name__)


def scores_prompt(path: str, body: SharedBody) -> bool:
    return path == "/v1/completions" and body.fields.get("echo") is True and body.fields.get("logprobs") is not None


def check_echo_bound(path: str, body: dict[str, Any], tokens: PromptTokens | None) -> None:
    """`echo` with `logprobs` bounded at the edge: prompt tokens (every prompt of a batch) x (logprobs + 1) x n,
    or a 400 naming the fields. A token prompt's length is exact, a text prompt's too with the router's
    `--tokenizer`; without one a text prompt counts as its UTF-8 bytes, which no token count exceeds (a byte-level
    tokenizer's token covers at least one byte), except in a request of one choice: its workers count it exactly
    and their 400 is the answer. Fields a worker would refuse are left for its 400."""
    n, logprobs = body.get("n", 1), body.get("logprobs")
    if path != "/v1/completions" or body.get("echo") is not True or type(logprobs) is not int or not valid_n(n):
        return
    prompts = split_prompts(body.get("prompt"))
    sizes = [_prompt_size(p, tokens) for p in prompts]
    if all(exact for _, exact in sizes):
        check_echo_logprobs(sum(size for size, _ in sizes), logprobs, n)
    elif len(prompts) * n > 1:
        counted = "tokens (a text prompt's UTF-8 bytes: this router has no --tokenizer)"
        check_echo_logprobs(sum(size for size, _ in sizes), logprobs, n, counted)


def _prompt_size(prompt: Any, tokens: PromptTokens | None) -> tuple[int, bool]:
    """(its tokens, True), or (its UTF-8 bytes, False) for a text prompt the router cannot tokenise."""
    if isinstance(prompt, list):
        return len(prompt), True
    if not isinstance(prompt, str):
        return 0, True  # not a prompt: its worker says so
    if tokens is not None:
        return len(tokens.tokenizer.encode(prompt)), True
    return len(prompt.encode("utf-8", "surrogatepass")), False


async def with_prompt_logprobs(o: Opened, timeout_s: float) -> None:
    """Decode's first bytes (`o.first`: its whole answer, or its stream's first event) with prefill's prompt
    logprobs; unchanged when decode computed the prompt itself or prefill's answer does not have them."""
    if o.prefill is None:
        return
    try:
        prefill = await asyncio.wait_for(asyncio.shield(o.prefill), timeout_s)
        scored = prefill.body["choices"][0]["logprobs"]
        n = prefill.body["usage"]["prompt_tokens"]
    except (asyncio.TimeoutError, KeyError, IndexError, TypeError):
        log.warning("prefill's answer has no prompt logprobs: decode's answer goes out without them")
        return
    stream = o.first.startswith(b"data: ")
    head, sep, rest = o.first.partition(b"\n\n") if stream else (o.first, b"", b"")
    body = json.loads(head[6:] if stream else head)
    for choice in body.get("choices", []):
        lps = choice.get("logprobs")
        if lps:
            lps["token_logprobs"][:n] = scored["token_logprobs"][:n]
            lps["top_logprobs"][:n] = (scored["top_logprobs"] or [None] * n)[:n]
    data = json.dumps(body, ensure_ascii=False).encode()
    o.first = (b"data: " + data + sep + rest) if stream else data
