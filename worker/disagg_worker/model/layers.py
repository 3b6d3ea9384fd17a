"""Pieces every architecture composes: RMSNorm, the gated (SwiGLU) MLP, the KV cache a layer sees,
and the all-reduce that sums a row-parallel output over the tensor-parallel group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

AllReduce = Callable[[torch.Tensor], torch.Tensor]
_FUSED_DTYPES = {torch.float32, torch.bfloat16}  # what `triton_fused` rounds as torch does


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class Exchange(Protocol):
    """Rows between the tensor ranks of a stage (expert parallelism): rank r sends `send_counts[d]`
    consecutive rows of x to each rank d and gets `recv_counts[s]` rows from each rank s, in rank order."""

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor: ...


class KVCacheView(Protocol):
    """The KV pool as a layer sees it (`mem.kv_pool.KVPool`): per-head K and V, or MLA's latent."""

    page_size: int

    def k_buffer(self, layer: int) -> torch.Tensor: ...

    def v_buffer(self, layer: int) -> torch.Tensor: ...

    def latent_buffer(self, layer: int) -> torch.Tensor: ...


class Merged:
    """Several linear projections of one input as one GEMM: `weight` (and `bias`) their rows stacked, in order,
    each projection's own parameters being views into it (`merged.merge_projections`); a call returns the
    projections' outputs, views into one result."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, as Hugging Face does (on CUDA in one Triton
    kernel, `triton_fused.rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and {x.dtype, self.weight.dtype} <= _FUSED_DTYPES:  # one fused kernel, rounding as below
            from disagg_worker.model.triton_fused import rms_norm

            return rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) over this rank's `size` intermediate columns; `all_reduce` sums the
    ranks' partial outputs (an expert inside an MoE block leaves that to the block: `no_reduce`)."""

    def __init__(self, hidden: int, size: int, all_reduce: AllReduce = no_reduce):
        super().__init__()
        self.all_reduce = all_reduce
        self.gate_proj = nn.Linear(hidden, size, bias=False)
        self.up_proj = nn.Linear(hidden, size, bias=False)
        self.down_proj = nn.Linear(size, hidden, bias=False)
        self.gate_up: Merged | None = None  # gate and up as one GEMM: set by `merged.merge_projections`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        if gate.is_cuda and gate.dtype in _FUSED_DTYPES:  # one fused kernel, rounding as below
            from disagg_worker.model.triton_fused import silu_and_mul

            return self.all_reduce(self.down_proj(silu_and_mul(gate, up)))
        return self.all_reduce(self.down_proj(F.silu(gate) * up))
