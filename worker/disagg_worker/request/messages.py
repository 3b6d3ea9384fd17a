"""Messages between the HTTP front end and the scheduler process, and their one codec.

Both ends are processes of the same instance on the same host (zmq ipc sockets), so the codec is
pickle of these dataclasses; nothing here crosses a trust boundary.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field

from disagg_worker.request.params import SamplingParams
from disagg_worker.request.trail import Stage


@dataclass(frozen=True)
class BootstrapInfo:
    """Where a decode instance finds the prefill instance holding this request's KV."""

    host: str
    port: int
    room: int
    sig: str = ""  # the router's signature over (host, port, room) (`keys.sign_target`); "": unsigned
    # The prefill instance's attention group holding the KV (DP attention; None: an instance of one group).
    dp_rank: int | None = None

    @property
    def address(self) -> str:
        """The prefill bootstrap address decode resolves: the instance, or one attention group of it."""
        base = f"{self.host}:{self.port}"
        return base if self.dp_rank is None else f"{base}/dp/{self.dp_rank}"

    @property
    def signed_host(self) -> str:
        """What the router's signature covers as the host: the group too, so no caller can redirect it."""
        return self.host if self.dp_rank is None else f"{self.host}/dp/{self.dp_rank}"


@dataclass(frozen=True)
class Route:
    """Where a request runs, as the router (or the client) decided: its P/D bootstrap target, and which of
    this instance's attention groups takes it (DP attention; None: the instance chooses). `local_prefill`: the
    router sends the request to decode alone, which computes the prompt itself (conditional disaggregation)."""

    bootstrap: BootstrapInfo | None = None
    dp_rank: int | None = None
    local_prefill: bool = False
    local_sig: str = ""  # the router's signature on a local_prefill request (`keys.LOCAL_PREFILL`)
    # A request the router migrated from an instance that failed: the tokens it generated there (the prompt goes
    # on with them), and how many characters of their text the client already has.
    resume: tuple[int, ...] = ()
    resume_chars: int = 0


NO_ROUTE = Route()


@dataclass(frozen=True)
class GenerateReq:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    bootstrap: BootstrapInfo | None = None
    local_prefill: bool = False
    local_sig: str = ""
    # A migrated request: the last `resumed` of `input_ids` are tokens it generated on an instance that failed.
    # It samples on as if it had generated them here (its seed's draws and its grammar moved past them).
    resumed: int = 0
    # Part of a sampled trace: the scheduler records its stages (`request/trail.py`) and sends them back.
    traced: bool = False


@dataclass(frozen=True)
class AbortReq:
    rid: str


@dataclass(frozen=True)
class FlushCacheReq:
    """Evict every prefix-cache page no request holds."""


@dataclass(frozen=True)
class TokenOut:
    """New tokens of one request since its last TokenOut; `finish_reason` set on its last one."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    error_status: int = 0
    # OpenAI's error `code` (`request.errors`): the router does not retry an `internal_error` or `instance_failed`.
    error_code: str = ""
    # With the first tokens of a request that asked (`SamplingParams.prompt_logprobs`): the logprob of each prompt
    # token after the first, given the ones before it, and its top-N alternatives (empty lists without top-N).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # A traced request's stages in the scheduler that ended since its last TokenOut (`request/trail.py`).
    stages: tuple[Stage, ...] = ()


@dataclass(frozen=True)
class BatchOut:
    outputs: list[TokenOut]


@dataclass(frozen=True)
class EngineInfo:
    """Sent once by the scheduler when it is ready to serve."""

    model_name: str
    vocab_size: int
    max_context_len: int
    capacity_tokens: int
    page_size: int
    total_pages: int
    eos_token_ids: list[int]
    dp_rank: int = 0  # the attention group whose scheduler sent it (DP attention)


@dataclass(frozen=True)
class SchedulerStats:
    """Sent by the scheduler at least every heartbeat interval; /health and /metrics read it."""

    time: float
    running: int
    waiting: int
    pages_used: int
    pages_total: int
    cache_hit_tokens: int
    cache_query_tokens: int
    step_count: int
    cache_pages: int = 0
    cache_refs: int = 0
    # Prompt tokens this instance computed in forwards so far (not those its cache or a transfer supplied).
    prompt_tokens_computed: int = 0
    pid: int = 0
    # Prometheus exposition of the scheduler process's own series (KV transfer metrics).
    metrics_text: str = ""
    queues: dict[str, int] = field(default_factory=dict)
    # Every rank's P/D queue sizes in a multi-rank instance, by (tp_rank, pp_rank).
    rank_queues: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    dp_rank: int = 0  # the attention group whose scheduler sent it (DP attention)
    # What the prefix cache stored and evicted since the last report (mem/kv_events.py), in order.
    kv_events: tuple[tuple[str, list[int]], ...] = ()
    # Why the instance can no longer serve though its scheduler runs ("" while it can): /health says it.
    broken: str = ""
    # Pages taken while a step in flight still wrote them (`engine/in_flight.py`): 0 unless its rule broke.
    pages_taken_in_flight: int = 0
    # The LoRA adapters of the scheduler's running requests and of its waiting ones, each named once, in order.
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    # The adapters its slots hold (--max-loras of them at most), in slot order: the router prefers an instance
    # where a request's adapter is resident.
    lora_resident: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wake:
    """From another attention group's scheduler (DP attention): it is about to step, and every group steps with
    it; the receiver stops waiting on its inbox."""


Message = GenerateReq | AbortReq | FlushCacheReq | BatchOut | EngineInfo | SchedulerStats | Wake


def encode(msg: Message) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    return pickle.loads(data)
