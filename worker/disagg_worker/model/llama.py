"""The Llama family: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm); its
attention (per-head K and V in the pool, grouped-query) is also Qwen3-MoE's (`qwen3_moe.py`).

The layer's KV pool buffers are `k_buffer(layer)` and `v_buffer(layer)`, each [num_pages, page_size,
H_kv, D]. Under tensor parallelism each rank holds its query heads and KV heads (`Shard.heads`,
`Shard.kv_heads`) and `all_reduce` sums the output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg_worker.model.attention import AttentionPlan, paged_attention, write_kv
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.decoder import Blocks
from disagg_worker.model.layers import AllReduce, KVCacheView, Merged, RMSNorm
from disagg_worker.model.parallel import Shard
from disagg_worker.model.rope import Rotation


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, all_reduce: AllReduce):
        super().__init__()
        self.layer = layer  # index into this stage's KV pool
        self.num_heads, self.num_kv_heads = len(shard.heads(cfg)), len(shard.kv_heads(cfg))
        self.head_dim = cfg.head_dim
        self.all_reduce = all_reduce
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        # q/k/v's weights (and biases) as one tensor, theirs being views into it: set by `merged.merge_projections`.
        self.qkv: Merged | None = None

    def forward(self, x: torch.Tensor, rotation: Rotation, plan: AttentionPlan, kv: KVCacheView) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation(q, k)
        k_buf, v_buf = kv.k_buffer(self.layer), kv.v_buffer(self.layer)
        write_kv(k_buf, v_buf, k, v, plan.out_slots)
        out = paged_attention(q, plan, k_buf, v_buf)
        return self.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)))


BLOCKS = Blocks(attention=LlamaAttention)
