"""The role stage of a P/D instance: what a prefill or decode instance adds to the engine.

An engine in a P/D role owns one stage beside its scheduler. The engine hands it the requests
that arrive and the aborts, calls `tick` before each schedule (poll KV transfers) and `on_step`
after each processed forward (send the KV it computed); the loop asks `waiting_on_transfers` to
decide how long it may sleep. A monolithic engine has no stage.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from disagg_worker.config import EngineConfig, Role
from disagg_worker.disagg import AUX_ITEM_NBYTES, KVLayout, KVManager, KVReceiver, KVSender, RankInfo, create_kv_manager
from disagg_worker.engine.batch import StepOutcome
from disagg_worker.engine.drafting import draft_head_nbytes
from disagg_worker.engine.outbox import Outbox
from disagg_worker.engine.request import Req
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.messages import BootstrapInfo
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import Shard

UNROUTED = "a {role} instance serves requests routed with bootstrap_room; send requests through the router"


class Transfers(Protocol):
    """What a role stage needs of the KV transfer: this rank's `KVManager`, or in a multi-rank
    instance the ranks' agreement (`ranks.kv.RankedKV`)."""

    on_change: Callable[[], None]

    def create_sender(self, room: int) -> KVSender: ...
    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver: ...
    def close(self) -> None: ...


class RoleStage(Protocol):
    def arrive(self, req: Req, bootstrap: BootstrapInfo | None) -> None:
        """Take a new request (refused with a 400 when it was not routed with a bootstrap room)."""

    def abort(self, rid: str) -> bool:
        """Abort `rid` if this stage holds it; False when it is not here (the scheduler may have it)."""

    def tick(self) -> None:
        """Advance the transfer queues; never blocks."""

    def on_step(self, outcome: StepOutcome) -> None:
        """Act on what a processed forward did (prefill sends the KV it completed)."""

    @property
    def waiting_on_transfers(self) -> bool:
        """Requests wait on KV transfers: the loop polls often instead of sleeping."""

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """`wake` is called, from any thread, when a transfer this stage waits on moves."""

    def queue_sizes(self) -> dict[str, int]: ...

    def close(self) -> None:
        """Release what the stage holds outside this process (the transfer engine)."""


def aux_slots(cfg: EngineConfig) -> int:
    """First-token slots of a decode instance's KV layout (the same on every rank)."""
    return 2 * cfg.scheduler.max_running_requests


def build_kv_manager(
    cfg: EngineConfig, kv_pool: KVPool, shard: Shard, model_cfg: ModelConfig, draft_fingerprint: str = ""
) -> KVManager | None:
    """This rank's KV transfer manager for its slice of the pool (its KV heads, its stage's
    layers; under DP attention, as a rank of its attention group); None for a monolithic engine."""
    d = cfg.disagg
    layers = shard.layer_range(model_cfg.num_layers)
    start_layer, heads = layers.start, shard.kv_heads(model_cfg)
    spec = cfg.scheduler.speculative
    extra = kv_pool.num_layers - len(layers)  # a draft model's layers after the model's
    draft_kv = ""
    if extra:
        layers_of = f"{extra} layer{'s' if extra > 1 else ''} of {kv_pool.page_nbytes}-byte pages"
        draft_kv = f"{spec.algorithm} ({layers_of}, draft {draft_fingerprint})"
    if d.role is Role.PREFILL:
        layout = KVLayout.from_pool(
            kv_pool, cfg.cache.kv_dtype, start_layer=start_layer, kv_heads=heads, draft_kv=draft_kv
        )
        url = f"http://{d.leader_host}:{d.bootstrap_port}"  # pod 0's bootstrap server
        rank = RankInfo(shard.attn_tp_rank, shard.pp_rank, url, shard.dp_rank)
        return create_kv_manager(d, layout, rank)
    if d.role is Role.DECODE:
        layout = KVLayout.from_pool(
            kv_pool,
            cfg.cache.kv_dtype,
            start_layer=start_layer,
            kv_heads=heads,
            aux_num_slots=aux_slots(cfg),
            aux_item_nbytes=AUX_ITEM_NBYTES
            + (draft_head_nbytes(spec.eagle_topk, model_cfg.hidden_size) if extra else 0),
            draft_kv=draft_kv,
        )
        return create_kv_manager(d, layout, RankInfo(shard.attn_tp_rank, shard.pp_rank, dp_rank=shard.dp_rank))
    return None


def build_stage(
    cfg: EngineConfig, kv: Transfers | None, scheduler: Scheduler, allocator: PageAllocator, outbox: Outbox
) -> RoleStage | None:
    """The stage of `cfg`'s role over `kv` (this rank's manager, or every rank's agreement);
    None for a monolithic engine."""
    if kv is None:
        return None
    if cfg.disagg.role is Role.PREFILL:
        from disagg_worker.engine.prefill import PrefillStage

        whole = cfg.scheduler.speculative.uses_draft_model
        return PrefillStage(cfg.disagg, cfg.cache.page_size, scheduler, outbox, kv, whole_prompt=whole)
    from disagg_worker.engine.decode import DecodeStage

    return DecodeStage(cfg, scheduler, allocator, outbox, kv, aux_slots(cfg))
