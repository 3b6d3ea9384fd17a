"""Mixture-of-experts block: a router picks `top_k` experts per token, their gated MLPs run on the
tokens routed to them, the outputs are summed with the router's weights, plus shared experts' output.

Routing (`Router`), in float32 whatever the model's dtype:
- "softmax" (Qwen3-MoE): the top-k of the softmax over all experts, renormalised if `norm_topk_prob`;
- "sigmoid" (DeepSeek-V3, `noaux_tc`): sigmoid scores; experts are chosen by score +
  `e_score_correction_bias`, only among the `topk_group` groups (of `n_group`) whose best two such
  values sum highest; weights are the plain scores, renormalised if `norm_topk_prob`, times
  `routed_scaling_factor`.

Tensor parallelism slices every expert (and the shared experts) like a dense MLP: each rank holds
`intermediate_size / tp` columns of each, and one all-reduce sums the block's partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg_worker.model.config import MoEConfig
from disagg_worker.model.layers import AllReduce, GatedMLP


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, expert ids [T, top_k]) of every token of x [T, hidden]."""
        moe = self.moe
        logits = F.linear(x.float(), self.weight.float())
        if moe.scoring == "softmax":
            weights, ids = torch.topk(torch.softmax(logits, dim=-1), moe.top_k, dim=-1)
            return (weights / weights.sum(-1, keepdim=True) if moe.norm_topk_prob else weights), ids
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
        best = torch.topk(groups.topk(2, dim=-1)[0].sum(-1), moe.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros(groups.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
        ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if moe.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids


class MoE(nn.Module):
    """The routed experts `experts.<id>` this rank holds (all of them, each sliced by TP) and the
    shared experts; named as the checkpoints name them."""

    def __init__(self, hidden: int, moe: MoEConfig, tp_size: int, all_reduce: AllReduce):
        super().__init__()
        self.all_reduce = all_reduce
        self.gate = Router(hidden, moe)
        size = moe.intermediate_size // tp_size
        self.experts = nn.ModuleDict({str(e): GatedMLP(hidden, size) for e in range(moe.num_experts)})
        if moe.num_shared_experts:
            self.shared_experts = GatedMLP(hidden, moe.shared_intermediate_size // tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # ascending, as the reference adds them
            tokens, slot = torch.where(ids == e)
            y = self.experts[str(e)](x[tokens]) * weights[tokens, slot, None].to(x.dtype)
            out.index_add_(0, tokens, y)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return self.all_reduce(out)
