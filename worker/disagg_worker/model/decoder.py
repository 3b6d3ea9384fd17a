"""The decoder-only causal LM every architecture shares: embedding, a stack of pre-norm layers
(attention then MLP, each added to the residual), a final norm and the LM head.

An architecture (`model/registry.py`) supplies only what differs per layer: its attention (per-head
GQA in `llama.py`, latent MLA in `mla.py`) and its MLP (dense `layers.GatedMLP` or `moe.MoE`), as a
`Blocks`. Module names follow the Hugging Face checkpoints (`model.layers.N.self_attn.q_proj`, ...),
so the state dict keys are the safetensors names. The model is stateless across calls: the KV of
every token lives in the pool passed to `forward` (`layers.KVCacheView`).

Under tensor parallelism (`model.parallel.Shard`) each rank builds its slice and `all_reduce` sums
the row-parallel outputs. Under DP attention each attention group runs the attention of its own requests
(possibly none), and every layer's MLP runs on all groups' tokens: gathered before it, this group's rows
taken back after it (`GroupRows`). Under pipeline parallelism a stage holds a range of layers (its KV pool
indexes them from 0); the first stage embeds the tokens, the others take the previous stage's hidden
states, and only the last norms and projects to logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from disagg_worker.model.attention import AttentionPlan
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.layers import AllReduce, Exchange, GatedMLP, KVCacheView, RMSNorm, no_reduce
from disagg_worker.model.lora import LoraLayers
from disagg_worker.model.moe import MoE
from disagg_worker.model.parallel import Shard
from disagg_worker.model.rope import RotaryEmbedding, Rotation

# Called with a stage's layer number (from 0) once the forward computed it (layer-wise KV streaming).
AfterLayer = Callable[[int], None] | None


@dataclass(frozen=True)
class GroupRows:
    """DP attention, for one forward: the tokens of each attention group (`sizes`, group after group), this
    rank's group, and how to gather every group's rows from every rank."""

    sizes: tuple[int, ...]
    group: int
    gather_rows: Callable[[torch.Tensor, tuple[int, ...]], torch.Tensor]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows x -> every group's rows."""
        return self.gather_rows(x, self.sizes)

    def own(self, y: torch.Tensor) -> torch.Tensor:
        """Every group's rows y -> this group's."""
        start = sum(self.sizes[: self.group])
        return y[start : start + self.sizes[self.group]]


@dataclass(frozen=True)
class Collectives:
    """How this rank's layers talk to the other tensor ranks of its stage: the all-reduce of row-parallel
    outputs, and (expert parallelism) the exchange of token rows. A single rank needs neither. With DP
    attention the attention sums over its group only (`attn_all_reduce`) and `group_rows` says, once per
    forward, how many tokens each group brings to the MLPs."""

    all_reduce: AllReduce = no_reduce
    exchange: Exchange | None = None
    attn_all_reduce: AllReduce | None = None  # None: `all_reduce`
    group_rows: Callable[[int], GroupRows] | None = None


class AttentionFactory(Protocol):
    def __call__(self, cfg: ModelConfig, layer: int, shard: Shard, all_reduce: AllReduce) -> nn.Module: ...


@dataclass(frozen=True)
class Blocks:
    """What one architecture puts in a layer. `attention(cfg, pool_layer, shard, all_reduce)`;
    the MLP is an MoE block on the layers `cfg.moe` names, a dense gated MLP elsewhere."""

    attention: AttentionFactory

    def mlp(
        self, cfg: ModelConfig, layer: int, shard: Shard, all_reduce: AllReduce, exchange: Exchange | None
    ) -> nn.Module:
        if cfg.moe is not None and cfg.is_moe_layer(layer):
            return MoE(cfg.hidden_size, cfg.moe, shard, all_reduce, exchange)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size // shard.tp_size, all_reduce)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, blocks: Blocks, layer: int, pool_layer: int, shard: Shard, comm: Collectives):
        super().__init__()
        self.self_attn = blocks.attention(cfg, pool_layer, shard, comm.attn_all_reduce or comm.all_reduce)
        self.mlp = blocks.mlp(cfg, layer, shard, comm.all_reduce, comm.exchange)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, rotation: Rotation, plan: AttentionPlan, kv: KVCacheView, rows: GroupRows | None = None
    ) -> torch.Tensor:
        if h.shape[0]:  # an attention group without requests still joins the MLPs' collectives
            h = h + self.self_attn(self.input_layernorm(h), rotation, plan, kv)
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x) if rows is None else rows.own(self.mlp(rows.gather(x))))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, blocks: Blocks, shard: Shard, comm: Collectives):
        super().__init__()
        self.shard = shard
        self.group_rows = comm.group_rows
        if shard.first_stage or (cfg.tie_word_embeddings and shard.last_stage):
            # Weights always come from a checkpoint: skip the random init (normal_ on the meta
            # device costs seconds on first use).
            embedding = torch.empty(cfg.vocab_size, cfg.hidden_size)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=embedding)
        layers = shard.layer_range(cfg.num_layers)
        # Keyed by the global layer number, so parameter names stay the checkpoint's.
        self.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, blocks, i, i - layers.start, shard, comm) for i in layers}
        )
        if shard.last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Built on the CPU explicitly (also under a meta-device context); `.to(device)` moves it.
        self.rotary = RotaryEmbedding(cfg, device="cpu")

    def forward(
        self, batch: ForwardBatch, kv: KVCacheView, hidden: torch.Tensor | None = None, after_layer: AfterLayer = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the batch's new tokens after this stage's layers (normed on
        the last stage). The first stage embeds `batch.input_ids`; the others continue `hidden`.
        `after_layer(i)` is called once this stage's layer `i` (from 0) was computed: its KV is in `kv`."""
        plan = AttentionPlan.build(batch, batch.input_ids.device, kv.page_size)
        return self.run(batch.input_ids, batch.positions, plan, kv, hidden, after_layer)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv: KVCacheView,
        hidden: torch.Tensor | None = None,
        after_layer: AfterLayer = None,
    ) -> torch.Tensor:
        """`forward` over a plan made beforehand (a static decode step's: `engine.cuda_graphs`)."""
        h = self.embed_tokens(input_ids) if hidden is None else hidden
        rotation = self.rotary.at(positions, h.dtype)
        rows = self.group_rows(h.shape[0]) if self.group_rows is not None else None
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, rotation, plan, kv, rows)
            if after_layer is not None:
                after_layer(i)
        return self.norm(h) if self.shard.last_stage else h


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, blocks: Blocks, shard: Shard | None = None, comm: Collectives | None = None):
        super().__init__()
        self.config = cfg
        self.shard = shard or Shard()
        self.model = DecoderModel(cfg, blocks, self.shard, comm or Collectives())
        # An EAGLE draft reads the final hidden state of every new token: kept in `hidden` when asked.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.lora: LoraLayers | None = None  # adapters hooked on the projections (`model/lora.py`), if any
        if self.shard.last_stage:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the config says so."""
        if self.config.tie_word_embeddings and self.shard.last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    def routed_tokens(self) -> torch.Tensor | None:
        """Tokens routed to each expert so far, summed over this stage's MoE layers (None: no MoE layer here)."""
        counts = [m.routed for m in self.modules() if isinstance(m, MoE)]
        return torch.stack(counts).sum(0) if counts else None

    def finish_load(self) -> None:
        """Derive what layers compute from their loaded weights (MLA's absorbed projections)."""
        for m in self.modules():
            finish = getattr(m, "finish_load", None)
            if m is not self and callable(finish):
                finish()

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @torch.no_grad()
    def forward(
        self, batch: ForwardBatch, kv: KVCacheView, hidden: torch.Tensor | None = None, after_layer: AfterLayer = None
    ) -> torch.Tensor:
        """Run the new tokens of every request through this stage (`after_layer`: see `DecoderModel.forward`).

        On the last stage: float32 logits [rows, vocab] of each request's last token (or of its last
        `batch.num_logits[i]` tokens, a speculative draft's positions); on
        the others: the hidden states [T, hidden] for the next stage. The batch may be built on
        the CPU; its tensors are moved to the model's device.
        """
        batch = batch.to(self.device)
        if self.lora is not None:
            self.lora.select(batch.lora_slots, batch.extend_lens, self.device)
        h = self.model(batch, kv, hidden, after_layer)
        if not self.shard.last_stage:
            return h
        if self.keep_hidden:
            self.hidden = h
        rows = h if batch.is_decode and batch.num_logits is None else h[batch.logits_indices]
        return self.lm_head(rows).float()

    @torch.no_grad()
    def decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan, kv: KVCacheView
    ) -> torch.Tensor:
        """float32 logits [B, vocab] of a decode step (one new token per request, on the model's device) over a
        plan made beforehand: the static step of `engine.cuda_graphs`, on a single-stage model."""
        return self.lm_head(self.model.run(input_ids, positions, plan, kv)).float()
