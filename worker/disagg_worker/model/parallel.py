"""Tensor and pipeline parallel shapes of the model: which rank holds which slice of which tensor.

Megatron-style tensor parallelism: q/k/v and gate/up are column-parallel (each rank holds a slice of
the output rows), o and down are row-parallel (a slice of the input columns; the partial results are
summed with one all-reduce each). Attention heads split evenly; KV heads split when there are at least
as many as ranks, and are replicated otherwise (rank r holds KV head r * num_kv_heads // tp_size, the
one its query heads use). The embedding and the LM head are replicated: a lookup costs no compute,
and a replicated head keeps sampling on one rank with no per-step gather of logits; the price is the
head's memory on every rank (the LM head is a few percent of a Llama's compute).

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
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class Shard:
    """This rank's place: tensor-parallel rank among `tp_size`, pipeline stage among `pp_size`."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank (tp {self.tp_rank}, pp {self.pp_rank}) outside sizes {self.tp_size}x{self.pp_size}")

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
        """The query heads of this rank."""
        n = cfg.num_heads // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """The KV heads of this rank: an even slice, or the one replicated head its query heads use."""
        if cfg.num_kv_heads >= self.tp_size:
            n = cfg.num_kv_heads // self.tp_size
            return range(self.tp_rank * n, (self.tp_rank + 1) * n)
        head = self.tp_rank * cfg.num_kv_heads // self.tp_size
        return range(head, head + 1)


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def check_parallel(cfg: ModelConfig, tp_size: int, pp_size: int) -> str:
    """Why the model cannot run with these sizes ("" if it can), naming the values."""
    if tp_size < 1 or pp_size < 1:
        return f"tp_size and pp_size must be at least 1, got {tp_size} and {pp_size}"
    if cfg.num_heads % tp_size:
        return f"tp_size {tp_size} does not divide the {cfg.num_heads} attention heads"
    kv = cfg.num_kv_heads
    if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
        return f"tp_size {tp_size} and the {kv} KV heads: one must divide the other"
    if cfg.intermediate_size % tp_size:
        return f"tp_size {tp_size} does not divide the MLP size {cfg.intermediate_size}"
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
    module = m.group(2).rsplit(".", 1)[0]
    if module in _COLUMN:
        rows = _column_rows(module, cfg, shard)
        return (slice(rows.start, rows.stop), *_whole(shape[1:]))
    if module in _ROW and name.endswith(".weight"):
        cols = _row_cols(module, cfg, shard)
        return (slice(None), slice(cols.start, cols.stop))
    return _whole(shape)


def _whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in shape)


def _column_rows(module: str, cfg: ModelConfig, shard: Shard) -> range:
    d = cfg.head_dim
    if module == "self_attn.q_proj":
        heads = shard.heads(cfg)
        return range(heads.start * d, heads.stop * d)
    if module in ("self_attn.k_proj", "self_attn.v_proj"):
        kv = shard.kv_heads(cfg)
        return range(kv.start * d, kv.stop * d)
    n = cfg.intermediate_size // shard.tp_size
    return range(shard.tp_rank * n, (shard.tp_rank + 1) * n)


def _row_cols(module: str, cfg: ModelConfig, shard: Shard) -> range:
    if module == "self_attn.o_proj":
        heads = shard.heads(cfg)
        return range(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)
    n = cfg.intermediate_size // shard.tp_size
    return range(shard.tp_rank * n, (shard.tp_rank + 1) * n)
