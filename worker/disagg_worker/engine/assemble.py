"""How an engine is assembled: every part made once, each handed its collaborators when it is made.

`load_engine` loads this rank's slice of the model (and a draft) and sizes the KV pool; `build_engine` makes
the parts over a loaded model in the order they need each other (this rank's pool, transfer manager and runner,
`build_rank`; the page allocator, prefix cache and its tiers; the scheduler; the executor its steps run on;
the role stage) and the `Engine` over them. Nothing is patched in after it is made. The follower ranks of a
multi-rank instance (`instance.follower`) build their own parts with the same `load_rank`, `build_rank` and
`rank_work`. Each stage gets only the settings it uses, never the whole configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from disagg_worker.config import EngineConfig, Role
from disagg_worker.disagg import AUX_ITEM_NBYTES, KVLayout, KVManager, RankInfo, create_kv_manager
from disagg_worker.disagg.bootstrap import leader_url
from disagg_worker.engine import cuda_graphs
from disagg_worker.engine.decode import DecodeReq, DecodeStage
from disagg_worker.engine.drafting import Draft, draft_head_nbytes, load_draft
from disagg_worker.engine.engine import Engine, EngineParts
from disagg_worker.engine.executor import Executor, LocalExecutor, RankExecutor
from disagg_worker.engine.expert_load import ExpertLoad
from disagg_worker.engine.lora_registry import Resident
from disagg_worker.engine.memory import return_freed_memory
from disagg_worker.engine.monolithic import MonolithicStage
from disagg_worker.engine.outbox import Outbox
from disagg_worker.engine.pools import DTYPES, build_drafter, build_kv_pool, size_pool
from disagg_worker.engine.prefill import PrefillStage
from disagg_worker.engine.runner import ModelRunner
from disagg_worker.engine.scheduler import Scheduler
from disagg_worker.engine.speculative import DraftPlanner
from disagg_worker.engine.stage import RoleStage, Transfers
from disagg_worker.engine.tiers import build_tiers
from disagg_worker.mem.allocator import PageAllocator
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.mem.radix import RadixCache
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.loader import load_model
from disagg_worker.model.lora import LoraLayers, read_adapters
from disagg_worker.model.parallel import Shard
from disagg_worker.ranks.dist import Comm
from disagg_worker.ranks.group import RankGroup, StageWork
from disagg_worker.ranks.kv import RankedKV, RankTransfer
from disagg_worker.ranks.peers import Peers


def load_rank(
    cfg: EngineConfig, comm: Comm | None, drafts: bool = True
) -> tuple[torch.nn.Module, ModelConfig, Draft | None, EngineConfig]:
    """This rank's slice of the model, its draft model (with `drafts`, when `cfg` speculates with one), and
    `cfg` with the KV pool sized for what memory is left."""
    torch.manual_seed(cfg.seed)
    shard = comm.shard if comm is not None else Shard()
    collectives = comm.collectives() if comm is not None else None
    model, model_cfg = load_model(cfg.model_path, DTYPES[cfg.dtype], cfg.device, shard, collectives, cfg.quantization)
    if cfg.lora.enabled:  # checked at start-up (`cli_args.check_lora`)
        lora = cfg.lora
        model.lora = LoraLayers.attach(model, read_adapters(lora.adapters), lora.max_lora_rank, lora.max_loras)
    draft = load_draft(cfg, model, model_cfg) if drafts else None
    return_freed_memory()
    return model, model_cfg, draft, size_pool(cfg, model_cfg, shard, draft, comm)


def load_engine(cfg: EngineConfig, comm: Comm | None = None, peers: Sequence[str] = ()) -> Engine:
    """The engine of this process (the driver rank of a multi-rank instance), its model loaded. `peers`: the
    inboxes of the other attention groups' drivers (DP attention)."""
    model, model_cfg, draft, cfg = load_rank(cfg, comm)
    return build_engine(cfg, None if cfg.forward == "noop" else model, model_cfg, comm, draft, peers)


@dataclass
class RankParts:
    """What every rank holds: its slice of the KV pool, its KV transfer manager (P/D roles), its runner."""

    kv_pool: KVPool
    manager: KVManager | None
    runner: ModelRunner


def build_rank(
    cfg: EngineConfig,
    model: torch.nn.Module | None,
    model_cfg: ModelConfig,
    shard: Shard,
    draft: Draft | None = None,
    single_rank: bool = False,
) -> RankParts:
    """A rank's pool, transfer manager and runner (with the draft model's runner and, on an instance of one
    CUDA rank, the decode steps captured as graphs, with a padding page after the pool's)."""
    graphs = cuda_graphs.wanted(cfg, model, single_rank, draft is not None)
    kv_pool = build_kv_pool(cfg, model_cfg, shard, draft, cfg.cache.total_pages + 1 if graphs else None)
    manager = build_kv_manager(cfg, kv_pool, shard, model_cfg, draft.fingerprint if draft else "")
    drafter = build_drafter(cfg, draft, kv_pool, model_cfg) if draft is not None else None
    max_context_len = cfg.max_context_len or model_cfg.max_position_embeddings
    runner = ModelRunner(
        model,
        kv_pool,
        model_cfg.vocab_size,
        cfg.device,
        drafter,
        layer_stream=manager.layer_stream if manager is not None else None,
        graphs=cuda_graphs.captured(model, kv_pool, cfg.cache.total_pages, cfg, max_context_len) if graphs else None,
    )
    return RankParts(kv_pool, manager, runner)


def rank_work(
    cfg: EngineConfig, comm: Comm, rank: RankParts, driver: bool, drain_local_failures: bool = True
) -> tuple[StageWork, RankTransfer | None]:
    """A rank's side of every step (`ranks.group.StageWork`) over its runner and its transfer handles."""
    faulty = cfg.disagg.fault_fail_senders_on_stage == comm.shard.pp_rank
    transfer = RankTransfer(rank.manager, fail_new_senders=faulty) if rank.manager is not None else None
    work = StageWork(comm, rank.runner.forward, transfer, driver=driver, drain_local_failures=drain_local_failures)
    return work, transfer


def build_engine(
    cfg: EngineConfig,
    model: torch.nn.Module | None,
    model_cfg: ModelConfig,
    comm: Comm | None = None,
    draft: Draft | None = None,
    peers: Sequence[str] = (),
) -> Engine:
    """The engine over a loaded `model` (None: `--forward noop`), one rank or the driver of `comm`'s ranks."""
    shard = comm.shard if comm is not None else Shard()
    cache = cfg.cache
    # Under DP attention every group's MoE layers see every group's tokens: the first group's counts say all.
    expert_load = ExpertLoad(model if shard.dp_rank == 0 else None, cfg.disagg.ep_size)
    rank = build_rank(cfg, model, model_cfg, shard, draft, single_rank=comm is None)
    allocator = PageAllocator(cache.total_pages)
    radix = RadixCache(
        cache.page_size,
        allocator,
        enabled=cfg.uses_prefix_cache,
        record_events=cfg.uses_prefix_cache,
        names_key=cfg.disagg.kv_names[0],
    )
    outbox = Outbox()
    tiers = build_tiers(cfg, rank.kv_pool, rank.runner.drafter, radix, cfg.model_name)
    incoming: dict[str, DecodeReq] = {}  # decode's requests whose KV is on its way: they hold running slots
    scheduler = Scheduler(
        cfg.scheduler,
        cache.page_size,
        allocator,
        radix,
        outbox,
        future_inputs=shard.pp_size == 1,  # with several stages a request's next step waits for its token
        drafter=DraftPlanner(cfg.scheduler.speculative) if cfg.drafts else None,
        tiers=tiers,
        incoming=incoming,
        adapters=resident_adapters(cfg, model),
    )
    executor: Executor
    kv: Transfers | None = rank.manager
    if comm is None:
        executor = LocalExecutor(rank.runner, cfg.overlap)
    else:
        work, transfer = rank_work(cfg, comm, rank, driver=True)
        ranked = RankedKV(transfer) if transfer is not None else None
        executor = RankExecutor(RankGroup(comm, work, ranked, Peers(list(peers))), rank.runner, shard, cfg.disagg.role)
        kv = ranked
    stage = build_stage(
        cfg, kv, scheduler, allocator, outbox, rank.kv_pool.nbytes, rank.runner.wait_kv_written, incoming
    )
    parts = EngineParts(
        shard=shard,
        max_context_len=cfg.max_context_len or model_cfg.max_position_embeddings,
        kv_pool=rank.kv_pool,
        allocator=allocator,
        radix=radix,
        outbox=outbox,
        scheduler=scheduler,
        runner=rank.runner,
        executor=executor,
        stage=stage,
        tiers=tiers,
        manager=rank.manager,
        expert_load=expert_load,
    )
    return Engine(cfg, model_cfg, parts)


def resident_adapters(cfg: EngineConfig, model: torch.nn.Module | None) -> Resident:
    """The LoRA adapters resident in `model`'s slots, which the scheduler loads others into (none without one)."""
    lora = getattr(model, "lora", None)
    load = lora.load if isinstance(lora, LoraLayers) else (lambda slot, adapter: None)
    return Resident(cfg.lora.max_loras, len(cfg.lora.adapters), load)


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
        rank = RankInfo(shard.attn_tp_rank, shard.pp_rank, leader_url(d), shard.dp_rank)
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
    kv_written: Callable[[], None] = lambda: None,
    incoming: dict[str, DecodeReq] | None = None,
) -> RoleStage | MonolithicStage:
    """The stage of `cfg`'s role over `kv` (this rank's manager, or every rank's agreement); a monolithic
    engine's (no `kv`) holds nothing. `pool_nbytes`: this rank's KV pool, whose share per page traced
    transfers report; `kv_written`: waits for the last forward's KV (prefill sends it next); `incoming`: where
    decode keeps its requests whose KV is on its way (the scheduler counts them as running)."""
    if kv is None:
        return MonolithicStage(scheduler)
    draft_model = cfg.scheduler.speculative.uses_draft_model
    page_nbytes = pool_nbytes // max(1, cfg.cache.total_pages)
    d = cfg.disagg
    if d.role is Role.PREFILL:
        return PrefillStage(
            d,
            cfg.cache.page_size,
            scheduler,
            outbox,
            kv,
            whole_prompt=draft_model,
            page_nbytes=page_nbytes,
            stream_from=max(1, d.layer_pipeline_min_prefill_len) if d.layer_pipeline else 0,
            kv_written=kv_written,
        )
    return DecodeStage(
        d,
        cfg.cache.page_size,
        scheduler,
        allocator,
        outbox,
        kv,
        aux_slots=aux_slots(cfg),
        draft_model=draft_model,
        page_nbytes=page_nbytes,
        transfer=incoming,
    )
