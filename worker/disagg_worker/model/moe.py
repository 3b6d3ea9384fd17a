"""Mixture-of-experts block: a router picks `top_k` experts per token, their gated MLPs run on the
tokens routed to them, the outputs are summed with the router's weights, plus shared experts' output.

Routing (`Router`), in the precision the reference uses:
- "softmax" (Qwen3-MoE): logits in the model's dtype, the top-k of their float32 softmax, renormalised
  if `norm_topk_prob`, weights cast back to the model's dtype;
- "sigmoid" (DeepSeek-V3, `noaux_tc`): the router's weight and `e_score_correction_bias` stay float32
  whatever the model's dtype (`keeps_fp32`), and so do its scores and weights; experts are chosen by
  score + `e_score_correction_bias`, only among the `topk_group` groups (of `n_group`) whose best two
  such values sum highest; weights are the plain scores, renormalised if `norm_topk_prob`, times
  `routed_scaling_factor`.
An expert's output times its weight is added in the wider of the two dtypes, then cast to the model's.

Tensor parallelism slices every expert (and the shared experts) like a dense MLP: each rank holds
`intermediate_size / tp` columns of each, and one all-reduce sums the block's partial outputs.

Expert parallelism (`Shard.ep_size` = tp_size) gives each rank `num_experts / ep` experts whole. Every
rank routes every token (the router is cheap next to the experts, and every rank can then count every
expert's load); each rank dispatches the (token, expert) rows of its share of the tokens to the ranks
holding those experts, with their counts and expert ids (all-to-all), runs its experts on the rows it
receives, sends the outputs back (all-to-all), weights and sums them per token, and the shares are
gathered so every rank again holds every token's output (all-to-all). Shared experts stay sliced by TP.

`routed` counts the tokens routed to each expert (all of them, on every rank), the load EP fights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg_worker.model.config import MoEConfig
from disagg_worker.model.layers import AllReduce, Exchange, GatedMLP
from disagg_worker.model.parallel import Shard


def keeps_fp32(name: str, moe: MoEConfig | None) -> bool:
    """A checkpoint tensor loaded in float32 whatever the model's dtype (DeepSeek-V3's router, as the
    reference keeps it: a bf16 correction bias changes which experts are chosen)."""
    return (
        moe is not None and moe.scoring == "sigmoid" and name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
    )


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        if moe.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k], expert ids [T, top_k]) of every token of x [T, hidden]."""
        moe = self.moe
        if moe.scoring == "softmax":
            logits = F.linear(x, self.weight)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), moe.top_k, dim=-1)
            if moe.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return weights.to(logits.dtype), ids
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
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
    """The routed experts `experts.<id>` this rank holds and the shared experts; named as the checkpoints
    name them."""

    def __init__(self, hidden: int, moe: MoEConfig, shard: Shard, all_reduce: AllReduce, exchange: Exchange | None):
        super().__init__()
        self.moe, self.all_reduce = moe, all_reduce
        self.ep_size, self.ep_rank = shard.ep_size, shard.ep_rank
        if self.ep_size > 1 and exchange is None:
            raise ValueError("expert parallelism needs the ranks' exchange")
        self.exchange = exchange
        self.gate = Router(hidden, moe)
        size = moe.intermediate_size // (1 if self.ep_size > 1 else shard.tp_size)
        self.experts = nn.ModuleDict({str(e): GatedMLP(hidden, size) for e in shard.experts(moe.num_experts)})
        if moe.num_shared_experts:
            self.shared_experts = GatedMLP(hidden, moe.shared_intermediate_size // shard.tp_size)
        self.routed: torch.Tensor
        # Built on the CPU explicitly (also under a meta-device context); `.to(device)` moves it.
        zeros = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")
        self.register_buffer("routed", zeros, persistent=False)
        self.dense = False  # `_dense` instead of `_routed`: set around a static decode step (`engine.cuda_graphs`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        flat = ids.reshape(-1)
        self.routed.index_add_(0, flat, torch.ones_like(flat))  # `bincount` would ask the host for its size
        if self.ep_size > 1:
            out = self._dispatched(x, weights, ids)
            return out + self.all_reduce(self.shared_experts(x)) if hasattr(self, "shared_experts") else out
        out = self._dense(x, weights, ids) if self.dense else self._routed(x, weights, ids)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return self.all_reduce(out)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each chosen expert over its tokens (the host learns which experts were chosen)."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # ascending, as the reference adds them
            tokens, slot = torch.where(ids == e)
            out.index_add_(0, tokens, (self.experts[str(e)](x[tokens]) * weights[tokens, slot, None]).to(x.dtype))
        return out

    def _dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`_routed` without asking the host anything (a captured CUDA graph): every expert over every token,
        weighted 0 where the token was not routed to it: the same terms added in the same order, the others
        exact zeros (a product over all the rows may round unlike one over some), for num_experts / top_k times
        the expert FLOPs, and every expert's weights read even where a small batch routes to few."""
        out = torch.zeros_like(x)
        for e, expert in self.experts.items():  # ascending ids
            weight = (weights * (ids == int(e))).sum(-1, keepdim=True)  # one nonzero term at most: exact
            out = out + (expert(x) * weight).to(x.dtype)
        return out

    def _dispatched(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Routed experts' output for every token, each rank running only its own experts."""
        assert self.exchange is not None
        ep, me, n_exp = self.ep_size, self.ep_rank, self.moe.num_experts
        t, k = ids.shape
        shares = [len(c) for c in torch.arange(t).tensor_split(ep)]  # rank r dispatches token share r
        start = sum(shares[:me])
        # This rank's (token, expert) rows ordered by expert: consecutive per destination rank (a rank's
        # experts are consecutive ids), and each token's rows in ascending expert order, as without EP.
        expert = ids[start : start + shares[me]].reshape(-1)
        order = torch.argsort(expert, stable=True)
        expert = expert[order]
        token = torch.div(order, k, rounding_mode="floor")
        weight = weights[start : start + shares[me]].reshape(-1)[order]
        sends = torch.bincount(expert // (n_exp // ep), minlength=ep)
        # Counts and expert ids travel with the rows: no rank relies on another's routing being bitwise equal.
        recvs = self.exchange.all_to_all(sends, [1] * ep, [1] * ep).tolist()
        send_counts = sends.tolist()
        got = self.exchange.all_to_all(x[start + token], send_counts, recvs)
        got_expert = self.exchange.all_to_all(expert, send_counts, recvs)
        y = torch.empty_like(got)
        for e in torch.unique(got_expert).tolist():
            rows = got_expert == e
            y[rows] = self.experts[str(e)](got[rows])
        back = (self.exchange.all_to_all(y, recvs, send_counts) * weight[:, None]).to(x.dtype)
        # Each token's k outputs summed in ascending expert order by plain adds (no scattered atomic adds: the
        # same result on every run and device).
        by_token = torch.argsort(token, stable=True)
        grouped = token[by_token]
        slot = torch.arange(len(grouped), device=x.device) - torch.searchsorted(grouped, grouped)
        rows = torch.zeros(shares[me], k, x.shape[1], dtype=x.dtype, device=x.device)
        rows[grouped, slot] = back[by_token]
        part = rows[:, 0]
        for j in range(1, k):
            part = part + rows[:, j]
        return self.exchange.all_to_all(part.repeat(ep, 1), [shares[me]] * ep, shares)
