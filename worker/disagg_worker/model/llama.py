"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm).

Module names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...), so the
state dict keys are the safetensors names. The model is stateless across calls: the K/V of every
token lives in the pool passed to `forward`, which needs only `k_buffer(layer)`, `v_buffer(layer)`
(each [num_pages, page_size, H_kv, D]) and `page_size`.

Under tensor parallelism (`model.parallel.Shard`) each rank builds its slice: its query and KV heads,
its part of the MLP, and `all_reduce` sums the row-parallel outputs over the tensor-parallel group.
Under pipeline parallelism a stage holds a range of layers (its KV pool indexes them from 0); the
first stage embeds the tokens, the others take the previous stage's hidden states, and only the last
norms and projects to logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from disagg_worker.model.attention import AttentionPlan, paged_attention, write_kv
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import Shard
from disagg_worker.model.rope import RotaryEmbedding, Rotation

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class KVCacheView(Protocol):
    page_size: int

    def k_buffer(self, layer: int) -> torch.Tensor: ...

    def v_buffer(self, layer: int) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before the weight, as Hugging Face does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


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

    def forward(self, x: torch.Tensor, rotation: Rotation, plan: AttentionPlan, kv: KVCacheView) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation(q, k)
        k_buf, v_buf = kv.k_buffer(self.layer), kv.v_buffer(self.layer)
        write_kv(k_buf, v_buf, k, v, plan.out_slots)
        out = paged_attention(q, plan, k_buf, v_buf)
        return self.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, all_reduce: AllReduce):
        super().__init__()
        size = cfg.intermediate_size // shard.tp_size
        self.all_reduce = all_reduce
        self.gate_proj = nn.Linear(cfg.hidden_size, size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, size, bias=False)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, all_reduce: AllReduce):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer, shard, all_reduce)
        self.mlp = LlamaMLP(cfg, shard, all_reduce)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, rotation: Rotation, plan: AttentionPlan, kv: KVCacheView) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rotation, plan, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, all_reduce: AllReduce):
        super().__init__()
        self.shard = shard
        if shard.first_stage or (cfg.tie_word_embeddings and shard.last_stage):
            # Weights always come from a checkpoint: skip the random init (normal_ on the meta
            # device costs seconds on first use).
            embedding = torch.empty(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        layers = shard.layer_range(cfg.num_layers)
        # Keyed by the global layer number, so parameter names stay the checkpoint's.
        self.layers = nn.ModuleDict(
            {str(i): LlamaDecoderLayer(cfg, i - layers.start, shard, all_reduce) for i in layers}
        )
        if shard.last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Built on the CPU explicitly (also under a meta-device context); `.to(device)` moves it.
        self.rotary = RotaryEmbedding(cfg, device="cpu")

    def forward(self, batch: ForwardBatch, kv: KVCacheView, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens after this stage's layers (normed on
        the last stage). The first stage embeds `batch.input_ids`; the others continue `hidden`."""
        plan = AttentionPlan.build(batch, batch.input_ids.device)
        h = self.embed_tokens(batch.input_ids) if hidden is None else hidden
        rotation = self.rotary.at(batch.positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, rotation, plan, kv)
        return self.norm(h) if self.shard.last_stage else h


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard | None = None, all_reduce: AllReduce | None = None):
        super().__init__()
        self.config = cfg
        self.shard = shard or Shard()
        self.model = LlamaModel(cfg, self.shard, all_reduce or _no_reduce)
        if self.shard.last_stage:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the config says so."""
        if self.config.tie_word_embeddings and self.shard.last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: KVCacheView, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run the new tokens of every request through this stage.

        On the last stage: float32 logits [num_requests, vocab] of each request's last token; on
        the others: the hidden states [T, hidden] for the next stage. The batch may be built on
        the CPU; its tensors are moved to the model's device.
        """
        batch = batch.to(self.device)
        h = self.model(batch, kv, hidden)
        if not self.shard.last_stage:
            return h
        return self.lm_head(h[batch.logits_indices]).float()
