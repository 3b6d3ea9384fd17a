"""What the scheduler hands the model runner for one step, and what comes back from it and from the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from disagg_worker.engine.outbox import TopLogprobs
from disagg_worker.engine.prompt_logprobs import PromptScores, wants_rows
from disagg_worker.engine.request import Req
from disagg_worker.model.batch import ForwardBatch


@dataclass
class ScheduledBatch:
    """One forward: every request's new tokens, and which requests sample a token afterwards.

    In overlap mode a decode request's input token may not be known yet when the batch is built:
    `(j, req)` in `future` says input position j takes the token the previous step sampled for
    `req`; the runner fills it in just before the forward. `generated[i]` counts the output
    tokens request i has before this step's sample, the one in flight included. `drafts[i]` is
    request i's speculative draft ([] for none), computed after its last known token.
    """

    reqs: list[Req]
    forward: ForwardBatch
    samples: list[bool]
    generated: list[int]
    future: list[tuple[int, Req]]
    drafts: list[list[int]] | None = None

    def draft(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts is not None else []

    @property
    def num_tokens(self) -> int:
        return int(self.forward.input_ids.numel())


@dataclass
class StepResult:
    """Per request of the batch: the sampled token (or -1 where it did not sample). A request that verified a
    draft may have more: `extra[i]` lists its accepted tokens after the first, with their logprobs. `failed`
    holds the requests whose own sampling step raised (their token is a placeholder): they fail alone."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    extra: dict[int, list[tuple[int, float | None, list[tuple[int, float]] | None]]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)
    prompt: dict[int, PromptScores] = field(default_factory=dict)  # prompt chunks' logprobs (`prompt_logprobs.py`)


@dataclass(frozen=True)
class Sampled:
    req: Req
    token: int
    logprob: float | None
    top: TopLogprobs | None


@dataclass
class StepOutcome:
    """What one processed step did.

    `chunks`: prompt chunks that completed without sampling, as (request, tokens whose KV is now
    computed); `num_computed` may already count a later step still in flight. `handed_off`: the
    last token of `handoff` requests, which now belong to the caller with their pages.
    """

    sampled: list[Sampled] = field(default_factory=list)
    chunks: list[tuple[Req, int]] = field(default_factory=list)
    handed_off: list[Sampled] = field(default_factory=list)
    failed: list[Req] = field(default_factory=list)


def build_forward(
    reqs: list[Req], extend: list[int], page_size: int, drafts: list[list[int]] | None = None
) -> ForwardBatch:
    """Assemble the tensors for requests computing `extend[i]` tokens from `reqs[i].num_computed`.

    A token not known yet is the request's draft (`drafts[i]`, which then gets logits at each of its
    positions and the one before), or else a placeholder 0 that the step in flight will sample,
    filled in later from the previous step's samples. Slots of all requests come from one padded page
    table in a few vectorised ops (this runs every step).
    """
    starts = [r.num_computed for r in reqs]
    ends = [s + n for s, n in zip(starts, extend, strict=True)]
    ids: list[int] = []
    for i, (r, s, e) in enumerate(zip(reqs, starts, ends, strict=True)):
        chunk = r.tokens(s, e)
        ids.extend(chunk)
        unknown = e - s - len(chunk)
        ids.extend(drafts[i][:unknown] if drafts and drafts[i] else [0] * unknown)
    width = max((e + page_size - 1) // page_size for e in ends)
    table = torch.tensor([r.pages[:width] + [0] * (width - len(r.pages[:width])) for r in reqs], dtype=torch.long)
    pos = torch.arange(max(ends), dtype=torch.long)
    slots = table[:, pos // page_size] * page_size + pos % page_size  # [requests, longest]
    ext = torch.tensor(extend, dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(reqs)), ext)
    first = torch.repeat_interleave(torch.tensor(starts, dtype=torch.long) - (torch.cumsum(ext, 0) - ext), ext)
    positions = torch.arange(len(ids), dtype=torch.long) + first
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=positions,
        out_slots=slots[row, positions],
        extend_lens=list(extend),
        seq_lens=ends,
        kv_slots=[slots[i, :e] for i, e in enumerate(ends)],
        num_logits=_num_logits(reqs, starts, extend, drafts),
        lora_slots=[r.lora_slot for r in reqs] if any(r.lora_slot for r in reqs) else None,
    )


def _num_logits(
    reqs: list[Req], starts: list[int], extend: list[int], drafts: list[list[int]] | None
) -> list[int] | None:
    """Rows of logits per request: a draft's positions and the one before, a scored prompt chunk's every position."""
    counts = [1 + len(d) for d in drafts] if drafts else [1] * len(reqs)
    counts = [n if wants_rows(r, s) else c for r, s, n, c in zip(reqs, starts, extend, counts, strict=True)]
    return counts if any(c != 1 for c in counts) else None


def build_batch(plan: Plan, page_size: int) -> ScheduledBatch:
    """The step of `plan`: its forward, and each request moved past the tokens it computes (`num_computed`;
    `pending` counts a token this step samples)."""
    drafts = plan.drafts if any(plan.drafts) else None
    forward = build_forward(plan.reqs, plan.extend, page_size, drafts)
    samples, generated, future = [], [], []
    pos = 0
    for r, n in zip(plan.reqs, plan.extend, strict=True):
        pos += n
        if r.num_generated == 0:  # a chunk of its prompt
            r.trail.end("scheduler.waiting")
            r.trail.begin("forward", tokens=n, position=r.num_computed)
        if r.pending:
            future.append((pos - 1, r))
        r.num_computed += n  # with a draft, past the known tokens until `process` knows what was kept
        sample = r.num_computed >= r.seq_len
        samples.append(sample)
        generated.append(r.num_generated)
        if sample:
            r.pending += 1
    return ScheduledBatch(
        reqs=plan.reqs, forward=forward, samples=samples, generated=generated, future=future, drafts=drafts
    )


@dataclass
class Plan:
    """What the scheduler puts in a step: requests, the tokens each computes, each one's draft."""

    reqs: list[Req] = field(default_factory=list)
    extend: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)

    def add(self, req: Req, n: int) -> None:
        self.reqs.append(req)
        self.extend.append(n)
        self.drafts.append([])
