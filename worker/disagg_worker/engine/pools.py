"""The KV pools of an engine's rank: the model's, and a draft model's (in the model's pool when its pages
have the same shape, so that they travel with the model's pages; else in a pool of its own)."""

from __future__ import annotations

import torch

from disagg_worker.config import ConfigError, EngineConfig, Role
from disagg_worker.engine.drafting import Draft, ModelDrafter, PoolLayers
from disagg_worker.mem.kv_pool import KVKind, KVPool
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.layers import KVCacheView
from disagg_worker.model.parallel import Shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_kv_pool(cfg: EngineConfig, model_cfg: ModelConfig, shard: Shard, draft: Draft | None = None) -> KVPool:
    """This rank's KV pool: its stage's layers, its KV heads, every page; and after them a draft model's
    layers when their KV has the same shape (so that it travels with the model's pages)."""
    cache = cfg.cache
    heads = len(shard.kv_heads(model_cfg))
    extra = draft.num_layers if draft is not None and draft_shares_pool(draft, model_cfg, heads) else 0
    return KVPool(
        num_layers=len(shard.layer_range(model_cfg.num_layers)) + extra,
        num_pages=cache.total_pages,
        page_size=cache.page_size,
        num_kv_heads=heads,
        head_dim=model_cfg.kv_head_dim,
        dtype=DTYPES[cache.kv_dtype],
        device=cfg.device,
        kind=KVKind.MLA if model_cfg.mla else KVKind.MHA,
    )


def draft_shares_pool(draft: Draft, model_cfg: ModelConfig, heads: int) -> bool:
    """The draft's KV pages have the model's shape: its layers go in the model's pool."""
    return model_cfg.mla is None and (draft.num_kv_heads, draft.head_dim) == (heads, model_cfg.kv_head_dim)


def build_drafter(cfg: EngineConfig, draft: Draft, pool: KVPool, model_cfg: ModelConfig) -> ModelDrafter:
    """The draft model's runner: its KV in the model's pool after the model's layers, or in a pool of its own
    (monolithic only: a prefill could not send it with the model's pages)."""
    if draft_shares_pool(draft, model_cfg, pool.num_kv_heads):
        kv: KVCacheView = PoolLayers(pool, pool.num_layers - draft.num_layers)
    elif cfg.disagg.role is not Role.MONOLITHIC:
        raise ConfigError(
            f"--speculative-draft-model-path {cfg.scheduler.speculative.draft_model_path}: its KV "
            f"({draft.num_kv_heads} heads x {draft.head_dim}) differs in shape from the model's "
            f"({pool.num_kv_heads} x {pool.head_dim}), so a prefill instance could not send it with the model's "
            "pages; use a draft of the same KV shape, or EAGLE"
        )
    else:
        kv = KVPool(
            num_layers=draft.num_layers,
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            num_kv_heads=draft.num_kv_heads,
            head_dim=draft.head_dim,
            dtype=pool.dtype,
            device=pool.device,
        )
    return ModelDrafter(draft.model, kv, pool.page_size, cfg.scheduler.speculative.eagle_topk)
