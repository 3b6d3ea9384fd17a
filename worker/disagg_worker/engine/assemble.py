"""How an engine's role parts are assembled: this rank's KV transfer manager and the role stage.

The engine calls `build_stage` with what its stage works with (scheduler, allocator, outbox, the
transfer); the follower ranks call `build_kv_manager` alone. Each stage gets only the settings it
uses, never the whole configuration.
"""

from __future__ import annotations

from disagg_worker.config import EngineConfig, Role
from disagg_worker.disagg import AUX_ITEM_NBYTES, KVLayout, KVManager, RankInfo, create_kv_manager
from disagg_worker.engine.decode import DecodeStage
from disagg_worker.engine.drafting import draft_head_nbytes
from disagg_worker.engine.outbox import Outbox
from disagg_worker.engine.prefill import PrefillStage
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.stage import RoleStage, Transfers
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import Shard


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
            kv_pool, cfg.cache.kv_dtype, start_layer=start_layer, kv_heads=heads, draft_kv=draft_kv, draft_layers=extra
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
            draft_layers=extra,
        )
        return create_kv_manager(d, layout, RankInfo(shard.attn_tp_rank, shard.pp_rank, dp_rank=shard.dp_rank))
    return None


def build_stage(
    cfg: EngineConfig,
    kv: Transfers | None,
    scheduler: Scheduler,
    allocator: PageAllocator,
    outbox: Outbox,
    pool_nbytes: int = 0,
) -> RoleStage | None:
    """The stage of `cfg`'s role over `kv` (this rank's manager, or every rank's agreement);
    None for a monolithic engine. `pool_nbytes`: this rank's KV pool, whose share per page traced
    transfers report."""
    if kv is None:
        return None
    draft_model = cfg.scheduler.speculative.uses_draft_model
    page_nbytes = pool_nbytes // max(1, cfg.cache.total_pages)
    if cfg.disagg.role is Role.PREFILL:
        d = cfg.disagg
        return PrefillStage(
            d, cfg.cache.page_size, scheduler, outbox, kv, whole_prompt=draft_model, page_nbytes=page_nbytes,
            stream_from=max(1, d.layer_pipeline_min_prefill_len) if d.layer_pipeline else 0,
        )  # fmt: skip
    return DecodeStage(
        cfg.disagg,
        cfg.cache.page_size,
        scheduler,
        allocator,
        outbox,
        kv,
        aux_slots=aux_slots(cfg),
        draft_model=draft_model,
        page_nbytes=page_nbytes,
    )
