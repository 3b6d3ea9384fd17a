"""Which prefill ranks feed a decode rank, which of their KV heads and layers, and which layer
buffers map onto which.

Backend-neutral rules, checked when decode first resolves a prefill instance (before any
request is sent to it) so that a mismatch fails its rooms with a message naming both values.

Tensor parallelism: with `r` the ratio of the two TP sizes (one must divide the other), decode
rank `d` talks to the prefill ranks of its group: `[d * r, (d + 1) * r)` when decode has fewer
ranks (each prefill rank is asked by one decode rank), `d // r` when it has more (each prefill rank
is asked by `r` decode ranks and waits for all of them). Inside its group a decode rank takes each
of its KV heads from the first prefill rank that holds it, so a replicated head is written once;
a prefill rank of the group that holds nothing new is still asked, for nothing (its room must
finish). Pipeline parallelism: decode PP equal to prefill PP (stage to stage) or 1 (every stage).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.config import DisaggConfig
from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.bootstrap import RankRegistration
from disagg_worker.disagg.bootstrap_client import Topology


@dataclass(frozen=True)
class HeadSlice:
    """`count` consecutive KV heads: from head `src` of the prefill rank's buffers (local index)
    to head `dst` of decode's. `count == 0`: nothing to write."""

    src: int
    dst: int
    count: int


NOTHING = HeadSlice(0, 0, 0)


@dataclass(frozen=True)
class Target:
    """A prefill rank a decode rank pulls from, and what it takes there."""

    rank: RankRegistration
    heads: HeadSlice
    # Every head of a page on both sides: pages move whole, as with equal TP.
    whole: bool
    # Decode ranks that send this prefill rank a request for each room (it waits for all of them).
    decode_ranks: int

    @property
    def tp_rank(self) -> int:
        return self.rank.tp_rank

    @property
    def pp_rank(self) -> int:
        return self.rank.pp_rank

    @property
    def layers(self) -> range:
        return self.rank.layers


def check_compatible(
    topo: Topology, cfg: DisaggConfig, layout: KVLayout, tp_rank: int, pp_rank: int
) -> tuple[list[Target], str]:
    """The prefill ranks this decode rank pulls from, or ([], reason) naming both values."""
    if topo.page_size != layout.page_size:
        return [], f"page size mismatch: prefill page_size={topo.page_size}, decode page_size={layout.page_size}"
    draft = draft_mismatch(topo.ranks[0].draft_kv, layout.draft_kv)
    if draft:
        return [], draft
    kind = topo.ranks[0].kv_kind
    if kind != layout.kind.value:
        return (
            [],
            f"KV layout mismatch: prefill kv_kind={kind}, decode kv_kind={layout.kind.value} "
            "(an MLA latent and per-head K/V cannot be paired)",
        )
    if topo.kv_dtype != layout.kv_dtype:
        return [], f"KV dtype mismatch: prefill kv_dtype={topo.kv_dtype}, decode kv_dtype={layout.kv_dtype}"
    head = topo.ranks[0].head_nbytes
    if head != layout.head_nbytes:
        return (
            [],
            f"KV head size mismatch: prefill head_nbytes={head}, decode head_nbytes={layout.head_nbytes} "
            "(head_dim x element size)",
        )
    if topo.tp_size % cfg.attn_tp_size and cfg.attn_tp_size % topo.tp_size:
        return (
            [],
            f"unsupported TP mapping: prefill tp_size={topo.tp_size}, decode tp_size={cfg.attn_tp_size} "
            "(one must divide the other)",
        )
    if cfg.pp_size not in (topo.pp_size, 1):
        return (
            [],
            f"unsupported PP mapping: prefill pp_size={topo.pp_size}, decode pp_size={cfg.pp_size} "
            "(must be equal or 1)",
        )
    stages = [pp_rank] if cfg.pp_size == topo.pp_size else list(range(topo.pp_size))
    problem = _check_layers(topo, stages, layout)
    if problem:
        return [], problem
    group, fan_in = tp_group(topo.tp_size, cfg.attn_tp_size, tp_rank)
    targets: list[Target] = []
    for pp in stages:
        problem = _take_heads([topo.rank(tp, pp) for tp in group], layout, fan_in, targets)
        if problem:
            return [], problem
    return targets, ""


def draft_mismatch(prefill: str, decode: str) -> str:
    """Why a prefill and a decode instance cannot pair over their draft models' KV ("" when they can)."""
    if prefill == decode:
        return ""
    return (
        f"speculative decoding differs: prefill keeps draft KV {prefill or 'none'}, decode {decode or 'none'} "
        "(prefill and decode need the same --speculative-algorithm and --speculative-draft-model-path)"
    )


def tp_group(prefill_tp: int, decode_tp: int, decode_rank: int) -> tuple[list[int], int]:
    """The prefill TP ranks decode rank `decode_rank` asks, and how many decode ranks ask each."""
    if decode_tp <= prefill_tp:
        r = prefill_tp // decode_tp
        return list(range(decode_rank * r, (decode_rank + 1) * r)), 1
    r = decode_tp // prefill_tp
    return [decode_rank // r], r


def _check_layers(topo: Topology, stages: list[int], layout: KVLayout) -> str:
    """The stages this decode rank pulls from hold exactly its layers, together."""
    held = [layer for pp in stages for layer in topo.rank(0, pp).layers]
    want = range(layout.start_layer, layout.start_layer + layout.num_layers)
    if held == list(want):
        return ""
    span = f"[{held[0]}, {held[-1] + 1})" if held and held == list(range(held[0], held[-1] + 1)) else str(held)
    return (
        f"layer mismatch: prefill pp_rank {stages[0] if len(stages) == 1 else stages} holds layers {span}, "
        f"decode holds [{want.start}, {want.stop})"
    )


def _take_heads(ranks: list[RankRegistration], layout: KVLayout, fan_in: int, out: list[Target]) -> str:
    """Append one target per rank of a stage's group: the decode heads it is the first to hold."""
    taken: dict[int, list[int]] = {r.tp_rank: [] for r in ranks}
    for h in layout.kv_heads:
        holder = next((r for r in ranks if h in r.kv_heads), None)
        if holder is None:
            held = ", ".join(f"tp_rank={r.tp_rank} [{r.kv_heads.start}, {r.kv_heads.stop})" for r in ranks)
            return (
                f"KV head mismatch: decode holds KV heads [{layout.kv_heads.start}, {layout.kv_heads.stop}), "
                f"prefill holds {held}; none holds head {h}"
            )
        taken[holder.tp_rank].append(h)
    for r in ranks:
        heads = taken[r.tp_rank]
        if heads and heads != list(range(heads[0], heads[0] + len(heads))):
            return f"KV head mismatch: decode would take heads {heads} from prefill tp_rank={r.tp_rank}"
        part = HeadSlice(heads[0] - r.kv_head_start, heads[0] - layout.kv_head_start, len(heads)) if heads else NOTHING
        whole = len(heads) == r.num_kv_heads == layout.num_kv_heads
        out.append(Target(rank=r, heads=part, whole=whole, decode_ranks=fan_in))
    return ""


def layer_buffer_map(src_start: int, src_layers: int, dst_start: int, dst_layers: int, per_layer: int = 2) -> list[int]:
    """Map buffers `[K_0..K_{n-1}, V_0..V_{n-1}]` (`per_layer` 2; MLA's latents `[C_0..C_{n-1}]`: 1)
    of a rank holding layers `[src_start, src_start + src_layers)` onto the same layers of a rank
    holding `[dst_start, dst_start + dst_layers)`. Raises ValueError if a layer has no destination."""
    if src_start < dst_start or src_start + src_layers > dst_start + dst_layers:
        raise ValueError(
            f"prefill layers [{src_start}, {src_start + src_layers}) not held by decode layers "
            f"[{dst_start}, {dst_start + dst_layers})"
        )
    offset = src_start - dst_start
    keys = [offset + i for i in range(src_layers)]
    return [b * dst_layers + k for b in range(per_layer) for k in keys]
