"""OpenAI response bodies, built from the deltas of each choice. Pure functions."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.server.frontend import Delta


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


def usage_chunk(rid: str, model: str, obj: str, choices: list[Choice], prompt_tokens: int) -> dict:
    return {
        "id": rid,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage(choices, prompt_tokens),
    }
