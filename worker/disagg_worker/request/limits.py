"""The limits a request must respect, each rule checked in one place with one message.

Built from what the scheduler process reports at start-up (`EngineInfo`): the vocabulary size,
the context length and the KV capacity. The HTTP process checks every request against them before
it reaches the scheduler, answering 400 with `param` naming the field; the engine checks only the
rule that protects its own queues (a prompt it could never hold), with the same words.

`body_limit_bytes` bounds a request body by the same context: the worker's HTTP front end and the
router answer 413 beyond it before reading the body.

Pure Python: the HTTP process, the router and the engine all import it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from disagg_worker.request.errors import bad_request
from disagg_worker.request.params import MAX_TOKEN_ID, SamplingParams
from disagg_worker.tuning import TUNING

if TYPE_CHECKING:
    from disagg_worker.request.messages import EngineInfo

# Token ids are checked against the vocabulary when its size is known, else against MAX_TOKEN_ID.
CONTEXT_EXCEEDED = "context_length_exceeded"
# JSON bytes one context token may take in a request body. A token id in a list takes at most 12
# ("2147483647, "); text averages 3-5 bytes per token, and the heaviest real text (CJK written as
# \uXXXX escapes, indentation written as \t) takes 12-16: twice that leaves room for chat markup.
BODY_BYTES_PER_TOKEN = 32
# Everything besides the prompt: sampling fields, up to MAX_STOP_STRINGS escaped stop strings.
BODY_OVERHEAD_BYTES = 1 << 20
# The fields whose product `check_echo_logprobs` bounds (with the prompt's length).
ECHO_LOGPROBS_PARAM = "echo, logprobs, n"


def body_limit_bytes(max_context_len: int) -> int:
    """The largest request body worth reading for a model of `max_context_len` tokens.

    A body beyond it holds a prompt that cannot fit the context, whatever its encoding.
    """
    return BODY_BYTES_PER_TOKEN * max(1, max_context_len) + BODY_OVERHEAD_BYTES


def check_echo_logprobs(prompt_tokens: int, logprobs: int | None, n: int, counted: str = "tokens") -> None:
    """Completions' `echo` with `logprobs`: prompt tokens x (logprobs + 1) x n prompt-logprob entries in one
    answer, at most `TUNING.request.echo_logprob_entries` (tuning.py gives the arithmetic). `prompt_tokens`
    counts every prompt of a batch; `counted` says what it counts when that is not tokens."""
    if logprobs is None:
        return
    bound = TUNING.request.echo_logprob_entries
    entries = prompt_tokens * (logprobs + 1) * n
    if entries > bound:
        raise bad_request(
            f"echo with logprobs answers every prompt token's logprobs in each choice: {prompt_tokens} prompt "
            f"{counted} x (logprobs {logprobs} + 1) x n {n} = {entries} entries, more than the {bound} one request "
            "may hold; lower logprobs or n, or send a shorter prompt",
            ECHO_LOGPROBS_PARAM,
        )


@dataclass(frozen=True)
class RequestLimits:
    max_context_len: int
    vocab_size: int | None = None
    # Tokens of KV one request may hold (the whole pool); None: not known here.
    capacity_tokens: int | None = None

    @classmethod
    def from_info(cls, info: EngineInfo) -> RequestLimits:
        return cls(info.max_context_len, info.vocab_size, info.capacity_tokens)

    @property
    def token_id_bound(self) -> int:
        return self.vocab_size or MAX_TOKEN_ID

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Every id names a token of the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.token_id_bound), None)
        if bad is not None:
            raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {self.token_id_bound})", param)

    def kv_problem(self, prompt_len: int) -> str:
        """Why a prompt of `prompt_len` tokens can never be held in the KV cache ("" if it can)."""
        if self.capacity_tokens is not None and prompt_len + 1 > self.capacity_tokens:
            return f"prompt of {prompt_len} tokens does not fit the KV cache ({self.capacity_tokens} tokens)"
        return ""

    def check_prompt(self, ids: Sequence[int], param: str = "prompt") -> None:
        """A tokenised prompt: not empty, leaving room in the context, within the KV cache, in the vocabulary."""
        if not ids:
            raise bad_request(f"{param}: the prompt is empty", param)
        self._room(len(ids), param)
        problem = self.kv_problem(len(ids))
        if problem:
            raise bad_request(problem, param, CONTEXT_EXCEEDED)
        self.check_token_ids(ids, param)

    def _room(self, prompt_len: int, param: str) -> int:
        """Tokens of output the context leaves after the prompt (at least one, or a 400)."""
        room = self.max_context_len - prompt_len
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {self.max_context_len} tokens, but the prompt has "
                f"{prompt_len} tokens, which leaves no room for output.",
                param,
                CONTEXT_EXCEEDED,
            )
        return room

    def admit(
        self,
        ids: Sequence[int],
        sampling: SamplingParams,
        explicit: bool,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
    ) -> SamplingParams:
        """`check_prompt` then `fit`: what a tokenised request must pass before the scheduler."""
        self.check_prompt(ids, prompt_param)
        return self.fit(sampling, len(ids), explicit, param, prompt_param)

    def check_max_tokens(self, n: int, param: str) -> None:
        """An explicit output limit: at least one token, at most the context."""
        if n < 1:
            raise bad_request(f"{param}: must be at least 1, got {n}", param)
        if n > self.max_context_len:
            raise bad_request(
                f"{param}: must be at most this model's maximum context length of {self.max_context_len} "
                f"tokens, got {n if n < 10**40 else 'a huge integer'}",
                param,
            )

    def fit(
        self,
        sampling: SamplingParams,
        prompt_len: int,
        explicit: bool,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
    ) -> SamplingParams:
        """Make prompt + output fit the context, once the prompt length is known.

        A default max_new_tokens shrinks to the room left (min_new_tokens with it); an explicit one
        that does not fit, or a prompt that leaves no room at all, is a 400.
        """
        room = self._room(prompt_len, prompt_param)
        if sampling.max_new_tokens <= room:
            return sampling
        if explicit:
            raise bad_request(
                f"This model's maximum context length is {self.max_context_len} tokens. However, you requested "
                f"{prompt_len + sampling.max_new_tokens} tokens ({prompt_len} in the prompt, "
                f"{sampling.max_new_tokens} for the output).",
                param,
                CONTEXT_EXCEEDED,
            )
        return replace(sampling, max_new_tokens=room, min_new_tokens=min(sampling.min_new_tokens, room))
