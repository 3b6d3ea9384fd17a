"""Completions' `echo` with `logprobs` through P/D: the prompt's logprobs come from prefill.

Prefill computes the prompt, so its answer (the router reads it whole) holds the prompt's tokens with their
logprobs (`server/endpoints/completions.py`); decode's holds the same tokens with null logprobs, since it
received the prompt's KV without computing it. The router puts prefill's values into decode's answer, or into
the first event of decode's stream, before the client sees it. Such a stream does not migrate (a resumed stream would
echo the prompt again).
"""

from __future__ import annotations

import asyncio
import json
import logging

from disagg_worker.router.attempt import Opened
from disagg_worker.router.payload import SharedBody

log = logging.getLogger(__name__)


def scores_prompt(path: str, body: SharedBody) -> bool:
    return path == "/v1/completions" and body.fields.get("echo") is True and body.fields.get("logprobs") is not None


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
