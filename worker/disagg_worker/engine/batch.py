"""What the scheduler hands the model runner for one step, and what comes back."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from disagg_worker.engine.request import Req
from disagg_worker.model.batch import ForwardBatch


@dataclass
class ScheduledBatch:
    """One forward: every request's new tokens, and which requests sample a token afterwards.

    In overlap mode a decode request's input token may not be known yet when the batch is built:
    `(j, req)` in `future` says input position j takes the token the previous step sampled for
    `req`; the runner fills it in just before the forward.
    """

    reqs: list[Req]
    forward: ForwardBatch
    samples: list[bool]
    future: list[tuple[int, Req]]

    @property
    def num_tokens(self) -> int:
        return int(self.forward.input_ids.numel())


@dataclass
class StepResult:
    """Per request of the batch: the sampled token (or -1 where it did not sample)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def page_slots(pages: list[int], page_size: int, length: int) -> torch.Tensor:
    """Slots of positions [0, length) for a page table."""
    if length == 0:
        return torch.empty(0, dtype=torch.long)
    n_pages = (length + page_size - 1) // page_size
    p = torch.tensor(pages[:n_pages], dtype=torch.long)
    slots = (p[:, None] * page_size + torch.arange(page_size, dtype=torch.long)).flatten()
    return slots[:length]


def build_forward(
    reqs: list[Req], extend: list[int], page_size: int, known_tokens: list[list[int]]
) -> ForwardBatch:
    """Assemble the tensors for requests computing `extend[i]` tokens from `reqs[i].num_computed`.

    `known_tokens[i]` is the request's token ids as far as the scheduler knows them; positions past
    its end are placeholders (0) filled in later from the previous step's samples.
    """
    ids, positions, out_slots, kv_slots, seq_lens = [], [], [], [], []
    for r, n, toks in zip(reqs, extend, known_tokens):
        start = r.num_computed
        end = start + n
        chunk = toks[start:end]
        ids.extend(chunk + [0] * (n - len(chunk)))
        positions.append(torch.arange(start, end, dtype=torch.long))
        slots = page_slots(r.pages, page_size, end)
        kv_slots.append(slots)
        out_slots.append(slots[start:end])
        seq_lens.append(end)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.cat(positions),
        out_slots=torch.cat(out_slots),
        extend_lens=list(extend),
        seq_lens=seq_lens,
        kv_slots=kv_slots,
    )
