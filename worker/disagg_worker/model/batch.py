"""What the scheduler hands the model for one forward pass.

Requests are laid out one after another: request i owns `extend_lens[i]` consecutive entries of
`input_ids`/`positions`/`out_slots`. Its earlier tokens (a cached prefix, or previous chunks and
decode steps) are already in the KV pool; `kv_slots[i]` lists the slots of the whole sequence,
the new tokens' slots last, so `kv_slots[i][-extend_lens[i]:]` equals that request's `out_slots`.
A slot is `page * page_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of all requests, request after request
    positions: torch.Tensor  # [T] absolute position of each new token
    out_slots: torch.Tensor  # [T] KV slot where each new token's K/V is written
    extend_lens: list[int]  # per request: number of new tokens in this forward (sum == T)
    seq_lens: list[int]  # per request: total tokens incl. the new ones (prefix + new)
    kv_slots: list[torch.Tensor]  # per request: slots of its whole sequence, len == seq_lens[i]
    # Per request: how many of its last new tokens get logits (None: one each). A speculative draft is
    # verified at every position after the request's last known token (`engine/speculative.py`).
    num_logits: list[int] | None = None
    # Per request: the LoRA adapter it runs under (`model/lora.py`'s slot; 0: the base model). None: the base for all.
    lora_slots: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        """True when every request contributes exactly one new token."""
        return all(n == 1 for n in self.extend_lens)

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def logits_indices(self) -> torch.Tensor:
        """Index into the T new tokens of the tokens that get logits: each request's last new token, or its
        last `num_logits[i]`, in order."""
        dev = self.input_ids.device
        ends = torch.cumsum(torch.tensor(self.extend_lens, dtype=torch.long, device=dev), 0)
        if self.num_logits is None:
            return ends - 1
        counts = torch.tensor(self.num_logits, dtype=torch.long, device=dev)
        first = torch.repeat_interleave(ends - counts, counts)
        within = torch.arange(int(counts.sum()), device=dev) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        return first + within

    @property
    def num_logit_rows(self) -> int:
        return sum(self.num_logits) if self.num_logits is not None else self.num_requests

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with its tensors on `device` (`Tensor.to` does not copy tensors already there)."""
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            out_slots=self.out_slots.to(device),
            kv_slots=[s.to(device) for s in self.kv_slots],
        )


def empty_forward() -> ForwardBatch:
    """A forward over no tokens: an attention group without requests still runs the MLPs' collectives."""
    none = torch.zeros(0, dtype=torch.long)
    return ForwardBatch(input_ids=none, positions=none, out_slots=none, extend_lens=[], seq_lens=[], kv_slots=[])
