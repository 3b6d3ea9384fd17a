"""A request as the scheduler sees it: its tokens, its pages, and where it is in its life."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from disagg_worker.engine.sampling import SamplingParams, SamplingState
from disagg_worker.mem.radix import Node
from disagg_worker.request.trail import NO_TRAIL, Trail


def lora_ids(ids: list[int], adapter: str) -> list[int]:
    """`ids` moved above any vocabulary by an offset of `adapter`'s name: equal for one name on every instance
    (the names of KV events, host and store pages match across them), apart for two names."""
    offset = (
        (int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=4).digest(), "little") & 0x3FFFFFFF) + 1
    ) << 32
    return [offset + t for t in ids]


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token id, or (on the HTTP side) a stop string
    LENGTH = "length"  # max_new_tokens or the context length
    ABORT = "abort"  # client went away or the request was cancelled
    ERROR = "error"  # the request could not be served (message in Req.error)


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    max_context_len: int = 1 << 30
    arrival: float = field(default_factory=time.monotonic)
    # The matcher of a request with a grammar (`engine/grammar.py`); the sampling state uses it.
    matcher: Any = field(default=None, repr=False)

    # The output tokens, in one list: `append_token` is the only writer (the sampler reads it too).
    output_ids: list[int] = field(default_factory=list)
    # Tokens sampled by a forward still in flight (overlap mode): known to the runner, not yet here.
    pending: int = 0
    # KV slots written or scheduled to be written: positions [0, num_computed).
    num_computed: int = 0
    # Page table: token at position i lives in slot pages[i // page_size] * page_size + i % page_size.
    pages: list[int] = field(default_factory=list)
    # Pages borrowed from the prefix cache (the first len(prefix_pages) entries of `pages`), locked.
    prefix_pages: int = 0
    prefix_node: Node | None = None
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str = ""
    error_status: int = 0
    error_code: str = ""
    sampling: SamplingState = field(init=False, repr=False)
    # Prefill in a P/D deployment: when the last token is sampled, the scheduler hands the request
    # with its pages to the caller (which sends the KV) instead of releasing it.
    handoff: bool = False
    # A draft model's state for this request (`engine/drafting.py`), and on prefill what its draft hands
    # decode in the aux record.
    draft: Any = field(default=None, repr=False)
    draft_aux: bytes = field(default=b"", repr=False)
    # The prompt's logprobs as its chunks are computed (`SamplingParams.prompt_logprobs`): (logprob, top-N) of
    # prompt tokens 1.., sent with the first output.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list, repr=False)
    # The LoRA adapter it runs under (`engine/lora_registry.py`; 0: the base model; its name is `params.lora`), and
    # the model's slot holding it while the request is admitted (`model/lora.py`).
    lora_adapter: int = 0
    lora_slot: int = 0
    # A traced request's stages (`request/trail.py`); the others hold `NO_TRAIL`, which records nothing.
    trail: Trail = field(default=NO_TRAIL, repr=False)

    def __post_init__(self) -> None:
        self.sampling = SamplingState.create(self.params, self.prompt_ids, self.output_ids)
        self.sampling.matcher = self.matcher

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Known token ids at positions [start, end) without building the whole sequence."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def cache_ids(self, end: int) -> list[int]:
        """The ids under which the prefix cache knows tokens [0, end): an adapter's request's are moved into a range
        of its own (`lora_ids`), so its pages (and their names) are never another adapter's or the base's."""
        ids = self.fill_ids[:end]
        return lora_ids(ids, self.params.lora) if self.params.lora else ids

    @property
    def seq_len(self) -> int:
        """Tokens known to exist, counting those still being sampled."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def todo(self) -> int:
        """Known tokens whose KV is not computed yet; a decode step is the case todo == 1."""
        return self.seq_len - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.pending

    def remaining_new_tokens(self) -> int:
        by_len = self.params.max_new_tokens - self.num_generated
        by_ctx = self.max_context_len - self.seq_len
        return max(0, min(by_len, by_ctx))

    def append_token(self, token: int) -> None:
        """Record a new output token and decide whether it ends the request."""
        self.output_ids.append(token)
        self._check_finished(token)

    def _check_finished(self, token: int) -> None:
        """Decide whether `token`, just appended to output_ids, ends the request."""
        n = len(self.output_ids)
        if n >= self.params.min_new_tokens:
            if token in self.params.stop_token_ids:
                self.finish_reason = FinishReason.STOP
                return
            if not self.params.ignore_eos and token in self.eos_ids:
                self.finish_reason = FinishReason.STOP
                return
        if n >= self.params.max_new_tokens or len(self.prompt_ids) + n >= self.max_context_len:
            self.finish_reason = FinishReason.LENGTH

    def hand_off_after_first_token(self) -> None:
        """Prefill in a P/D deployment: compute the prompt, sample one token, then hand the request with its pages
        to the caller. The sampling state stays as it is (a migrated request's draws and grammar moved on)."""
        self.params = replace(self.params, max_new_tokens=1, min_new_tokens=0)
        self.sampling.params = self.params
        self.handoff = True

    def fail(self, status: int, message: str, code: str = "") -> None:
        self.finish_reason = FinishReason.ERROR
        self.error_status = status
        self.error = message
        self.error_code = code
