"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent KV cache.

Per token the cache holds one latent of `kv_lora_rank + qk_rope_head_dim` values (`MLAConfig.latent_dim`):
the normed compressed KV and the rotated rotary key shared by every head, instead of K and V per head.
Two forms, equal to the reference:
- extend (prefill, chunked prefill, mixed batches): the expanded form. A request's latents are projected
  up by `kv_b_proj` into per-head K (nope part + the shared rotary part) and V, then ordinary attention;
- decode: the absorbed form. `kv_b_proj`'s key half is folded into the query (q_nope @ W_UK lands in the
  latent space) and its value half applied after attention (out @ W_UV), so attention runs over the
  latents themselves: one [L, latent] read per request instead of [L, heads, head_dim] twice.

Tensor parallelism splits the heads (q, kv_b and o projections); the latent projections are replicated,
so every rank caches the whole latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg_worker.model.attention import AttentionPlan, flat_slots, gather_rows
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.layers import AllReduce, KVCacheView, RMSNorm
from disagg_worker.model.parallel import Shard
from disagg_worker.model.rope import Rotation

# The reference's low-rank norms take their default epsilon, not the config's.
LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, all_reduce: AllReduce):
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.m = m
        self.layer = layer  # index into this stage's KV pool
        self.num_heads = len(shard.heads(cfg))
        self.scale = cfg.softmax_scale
        self.all_reduce = all_reduce
        h, bias = cfg.hidden_size, cfg.attention_bias
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.num_heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * m.v_head_dim, h, bias=bias)
        self.w_uk: torch.Tensor | None = None  # [H, nope, kv_lora], set by finish_load
        self.w_uv: torch.Tensor | None = None  # [H, v, kv_lora]

    def finish_load(self) -> None:
        """Split `kv_b_proj` into the absorbed form's two halves (before any repacking of the linear)."""
        w = self.kv_b_proj.weight.detach().view(self.num_heads, -1, self.m.kv_lora_rank)
        self.w_uk, self.w_uv = w[:, : self.m.qk_nope_head_dim], w[:, self.m.qk_nope_head_dim :]

    def forward(self, x: torch.Tensor, rotation: Rotation, plan: AttentionPlan, kv: KVCacheView) -> torch.Tensor:
        m, t = self.m, x.shape[0]
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_pe = k_pe.view(t, 1, m.qk_rope_head_dim)
        q_pe, k_pe = rotation.interleaved(q_pe, k_pe) if m.rope_interleave else rotation(q_pe, k_pe)
        latents = flat_slots(kv.latent_buffer(self.layer))  # [slots, 1, latent_dim]
        latents[plan.out_slots] = torch.cat([self.kv_a_layernorm(c), k_pe[:, 0]], -1).unsqueeze(1).to(latents.dtype)
        if plan.decode_index is not None:
            out = self._absorbed(q_nope, q_pe, plan, latents)
        else:
            out = self._expanded(q_nope, q_pe, plan, latents)
        return self.all_reduce(self.o_proj(out.reshape(t, self.num_heads * m.v_head_dim)))

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, plan: AttentionPlan, latents: torch.Tensor):
        m, outs = self.m, []
        q = torch.cat([q_nope, q_pe], -1)
        for span in plan.spans:
            lat = gather_rows(latents, span.slots)[:, 0].to(q.dtype)  # [L, latent_dim]
            c, k_pe = lat.split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
            kv = self.kv_b_proj(c).view(-1, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
            k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], -1)
            k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)], -1)
            q_i = q[span.start : span.start + span.n].transpose(0, 1).unsqueeze(0)  # [1, H, n, qk]
            o = F.scaled_dot_product_attention(
                q_i,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
            )
            outs.append(o[0].transpose(0, 1))  # [n, H, v]
        return torch.cat(outs, 0)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, plan: AttentionPlan, latents: torch.Tensor):
        assert plan.decode_index is not None and self.w_uk is not None and self.w_uv is not None
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, self.w_uk.to(q_nope.dtype))
        # Every head attends over the same latents: the heads are the query rows of one attention head, so
        # the latents are read as they are (a per-head K/V view would copy them once per head).
        q = torch.cat([q_lat, q_pe], -1).unsqueeze(1)  # [B, 1, H, latent_dim]
        lat = gather_rows(latents, plan.decode_index).transpose(1, 2).to(q.dtype)  # [B, 1, Lmax, latent_dim]
        o = F.scaled_dot_product_attention(
            q, lat, lat[..., : self.m.kv_lora_rank], attn_mask=plan.decode_mask, scale=self.scale
        )  # [B, 1, H, kv_lora]; the mask [B, 1, 1, Lmax] holds for every head
        return torch.einsum("bhc,hvc->bhv", o.squeeze(1), self.w_uv.to(o.dtype))
