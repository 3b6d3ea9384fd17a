"""Tensor and pipeline parallel shapes of the model: which rank holds which slice of which tensor.

Megatron-style tensor parallelism: q/k/v and gate/up are column-parallel (each rank holds a slice of
the output rows), o and down are row-parallel (a slice of the input columns; the partial results are
summed with one all-reduce each). Attention heads split evenly; KV heads split when there are at least
as many as ranks, and are replicated otherwise (rank r holds KV head r * num_kv_heads // tp_size, the
one its query heads use). The embedding and the LM head are replicated: a lookup costs no compute,
and a replicated head keeps sampling on one rank with no per-step gather of logits; the price is the
head's memory on every rank (the LM head is a few percent of a Llama's compute).

MLA (DeepSeek) splits its heads the same way (q/q_b and kv_b column-parallel by head, o row-parallel)
and replicates its latent projections, so the latent KV is whole on every rank. MoE slices every
expert and the shared experts like a dense MLP; the router is replicated.

DP attention (`Shard.dp_size` > 1) splits the tensor ranks into `dp_size` attention groups of `tp_size /
dp_size` ranks: heads split (and KV heads are cached) within a group only, each group attending over its own
requests, while the MLP and MoE layers stay sliced over all `tp_size` ranks of the stage.

Pipeline parallelism splits the layers into contiguous ranges, the first stage also embedding and
the last also norming and projecting to logits.

`shard_slice` says, for a checkpoint tensor name, which part this rank reads, so a rank never
materialises tensors it does not hold. Pure: no torch.distributed here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from disagg_worker.model.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.\d+\.")
_EXPERT_ID = re.compile(r"^mlp\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Shard:
    """This rank's place: tensor-parallel rank among `tp_size`, pipeline stage among `pp_size`; with
    expert parallelism (`ep_size` equal to `tp_size`), the stage's tensor ranks share out the routed
    experts, each holding `num_experts / ep_size` of them whole (EP rank = TP rank); with DP attention
    (`dp_size` > 1), attention group `dp_rank` of `attn_tp_size` consecutive tensor ranks splits the heads
    among themselves only."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank (tp {self.tp_rank}, pp {self.pp_rank}) outside sizes {self.tp_size}x{self.pp_size}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size {self.ep_size} must be 1 or the tp_size {self.tp_size}")
        if self.dp_size < 1 or self.tp_size % self.dp_size:
            raise ValueError(f"dp_size {self.dp_size} must divide the tp_size {self.tp_size}")

    @property
    def attn_tp_size(self) -> int:
        """Tensor ranks of this rank's attention group (all of the stage's without DP attention)."""
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def dp_rank(self) -> int:
        """This rank's attention group (0 without DP attention)."""
        return self.tp_rank // self.attn_tp_size

    @property
    def attention(self) -> Shard:
        """This rank within its attention group, as the KV and its transfer see it: a group is an instance of
        `attn_tp_size` tensor ranks (the same as this shard without DP attention)."""
        return Shard(self.attn_tp_rank, self.attn_tp_size, self.pp_rank, self.pp_size)

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.ep_size > 1 else 0

    def experts(self, num_experts: int) -> range:
        """The routed experts this rank holds: all (each sliced by TP), or its EP share (whole)."""
        n = num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    @property
    def world_rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layer_range(self, num_layers: int) -> range:
        """The layers of this stage: an even split, earlier stages taking the remainder."""
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    def heads(self, cfg: ModelConfig) -> range:
        """The query heads of this rank (split within its attention group)."""
        n = cfg.num_heads // self.attn_tp_size
        return range(self.attn_tp_rank * n, (self.attn_tp_rank + 1) * n)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """The KV heads this rank caches: an even slice, or the one replicated head its query heads
        use (MLA's single latent is such a head: every rank holds it whole)."""
        n_kv, tp, rank = cfg.kv_num_heads, self.attn_tp_size, self.attn_tp_rank
        if n_kv >= tp:
            n = n_kv // tp
            return range(rank * n, (rank + 1) * n)
        head = rank * n_kv // tp
        return range(head, head + 1)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_parallel(cfg: ModelConfig, tp_size: int, pp_size: int, ep_size: int = 1, dp_size: int = 1) -> str:
    """Why the model cannot run with these sizes ("" if it can), naming the values. `dp_size`: attention
    groups (DP attention), whose `tp_size / dp_size` ranks split the heads."""
    if tp_size < 1 or pp_size < 1:
        return f"tp_size and pp_size must be at least 1, got {tp_size} and {pp_size}"
    if dp_size < 1 or tp_size % dp_size:
        return f"dp_size {dp_size} does not divide tp_size {tp_size}"
    if ep_size > 1 and cfg.moe is None:
        return f"ep_size {ep_size}: the {cfg.arch} model has no experts to spread"
    if cfg.moe is not None and cfg.moe.num_experts % ep_size:
        return f"ep_size {ep_size} does not divide the {cfg.moe.num_experts} routed experts"
    attn = tp_size // dp_size
    what = f"tp_size {tp_size}" if dp_size == 1 else f"an attention group's {attn} ranks (tp_size / dp_size)"
    if cfg.num_heads % attn:
        return f"{what} does not divide the {cfg.num_heads} attention heads"
    kv = cfg.num_kv_heads
    if cfg.mla is None and ((kv >= attn and kv % attn) or (kv < attn and attn % kv)):
        return f"{what} and the {kv} KV heads: one must divide the other"
    dense = cfg.moe is None or len(cfg.moe.layers) < cfg.num_layers
    if dense and cfg.intermediate_size % tp_size:
        return f"tp_size {tp_size} does not divide the MLP size {cfg.intermediate_size}"
    if cfg.moe is not None:
        sliced = [("shared expert", cfg.moe.shared_intermediate_size)]
        if ep_size == 1:  # under EP each expert is held whole
            sliced.append(("expert", cfg.moe.intermediate_size))
        for what, size in sliced:
            if size % tp_size:
                return f"tp_size {tp_size} does not divide the {what} MLP size {size}"
    if pp_size > cfg.num_layers:
        return f"pp_size {pp_size} exceeds the {cfg.num_layers} layers"
    return ""


def shard_slice(name: str, shape: tuple[int, ...], cfg: ModelConfig, shard: Shard) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `name` (full `shape`) this rank holds: a slice per dimension,
    or None when this rank holds none of it (another stage's layer, embedding or head)."""
    m = _LAYER.match(name)
    if m is None:
        if name.startswith("model.embed_tokens."):
            return _whole(shape) if shard.first_stage or (cfg.tie_word_embeddings and shard.last_stage) else None
        if name.startswith(("model.norm.", "lm_head.")):
            return _whole(shape) if shard.last_stage else None
        return _whole(shape)
    if int(m.group(1)) not in shard.layer_range(cfg.num_layers):
        return None
    expert = _EXPERT_ID.match(m.group(2))
    if expert is not None and shard.ep_size > 1 and cfg.moe is not None:
        return _whole(shape) if int(expert.group(1)) in shard.experts(cfg.moe.num_experts) else None
    module = _EXPERT.sub("mlp.experts.", m.group(2).rsplit(".", 1)[0])
    part = _split(module, cfg, shard)
    if part is None:
        return _whole(shape)
    axis, rows = part
    if axis == 0:  # column-parallel: output rows, and the bias with them
        return (slice(rows.start, rows.stop), *_whole(shape[1:]))
    if name.endswith(".weight"):  # row-parallel: input columns
        return (slice(None), slice(rows.start, rows.stop))
    return _whole(shape)


def _whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in shape)


def _split(module: str, cfg: ModelConfig, shard: Shard) -> tuple[int, range] | None:
    """(0, output rows) of a column-parallel module, (1, input columns) of a row-parallel one, None:
    replicated (norms, routers, MLA's latent projections)."""
    heads, kv, mla = shard.heads(cfg), shard.kv_heads(cfg), cfg.mla

    def per_head(d: int, hs: range = heads) -> range:
        return range(hs.start * d, hs.stop * d)

    def mlp(size: int) -> range:
        n = size // shard.tp_size
        return range(shard.tp_rank * n, (shard.tp_rank + 1) * n)

    if module.startswith("self_attn."):
        attn = module.removeprefix("self_attn.")
        if mla is not None:
            kv_b = mla.qk_nope_head_dim + mla.v_head_dim
            rows = {"q_proj": mla.qk_head_dim, "q_b_proj": mla.qk_head_dim, "kv_b_proj": kv_b}
            if attn in rows:
                return 0, per_head(rows[attn])
            return (1, per_head(mla.v_head_dim)) if attn == "o_proj" else None
        if attn == "q_proj":
            return 0, per_head(cfg.head_dim)
        if attn in ("k_proj", "v_proj"):
            return 0, per_head(cfg.head_dim, kv)
        return (1, per_head(cfg.head_dim)) if attn == "o_proj" else None
    sizes = {"mlp.": cfg.intermediate_size}
    if cfg.moe is not None:
        sizes |= {"mlp.experts.": cfg.moe.intermediate_size, "mlp.shared_experts.": cfg.moe.shared_intermediate_size}
    prefix, _, proj = module.rpartition(".")
    if prefix + "." not in sizes or proj not in ("gate_proj", "up_proj", "down_proj"):
        return None
    return (1 if proj == "down_proj" else 0), mlp(sizes[prefix + "."])
