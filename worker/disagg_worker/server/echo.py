"""Completions' `echo`: the answer starts with the prompt, and with `logprobs` the prompt's tokens come with
theirs as vLLM returns them: the first prompt token's logprob is null (nothing precedes it), each other's is
its log-probability given the tokens before it (`engine/prompt_logprobs.py`), its top-N alternatives beside
it. With `max_tokens: 0` the prompt is the whole answer (the one token the engine generates is dropped).

Through P/D the prompt is computed by prefill: decode's answer carries the prompt's tokens with null logprobs,
which the router fills in from prefill's answer (`router/echo.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.server.frontend import Delta
from disagg_worker.server.openai_format import Choice, completion_logprobs


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
        if self.logprobs:
            out["logprobs"] = self._joined(tok, c.prompt_logprobs, c.prompt_top_logprobs, choice["logprobs"], prompt)
        return out

    def first_chunk(self, tok: Tokenizer, choice: dict, d: Delta) -> None:
        """The first streamed chunk of a choice: the prompt (and its logprobs) comes before the first text."""
        prompt = self.prompt_text
        if self.only:
            choice["text"], choice["logprobs"], choice["finish_reason"] = "", None, "length"
        choice["text"] = prompt + choice["text"]
        if self.logprobs:
            choice["logprobs"] = self._joined(tok, d.prompt_logprobs, d.prompt_top_logprobs, choice["logprobs"], prompt)

    def _joined(self, tok: Tokenizer, lps, tops, generated: dict | None, prompt: str) -> dict:
        part = self.prompt_part(tok, lps, tops)
        if self.only or not generated:
            return part
        shift = len(prompt)
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
