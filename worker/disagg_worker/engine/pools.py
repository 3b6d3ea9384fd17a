"""The KV pools of an engine's rank: the model's, and a draft model's (in the model's pool when its pages
have the same shape, so that they travel with the model's pages; else in a pool of its own); and how many
pages they hold when `--mem-fraction-static` sizes them by the device's memory (`size_pool`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from disagg_worker.config import ConfigError, EngineConfig, Role
from disagg_worker.engine.drafting import Draft, ModelDrafter, PoolLayers
from disagg_worker.mem.kv_pool import KVKind, KVPool
from disagg_worker.mem.sizing import FLAG, host_memory, pages_for_fraction, process_resident
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.layers import KVCacheView
from disagg_worker.model.parallel import Shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


class MinOverRanks(Protocol):
    def min_over_ranks(self, value: int) -> int: ...


def build_kv_pool(
    cfg: EngineConfig, model_cfg: ModelConfig, shard: Shard, draft: Draft | None = None, num_pages: int | None = None
) -> KVPool:
    """This rank's KV pool: its stage's layers, its KV heads, every page (`num_pages`: that many instead);
    and after them a draft model's layers when their KV has the same shape (so that it travels with the
    model's pages)."""
    cache = cfg.cache
    heads = len(shard.kv_heads(model_cfg))
    extra = draft.num_layers if draft is not None and draft_shares_pool(draft, model_cfg, heads) else 0
    return KVPool(
        num_layers=len(shard.layer_range(model_cfg.num_layers)) + extra,
        num_pages=cache.total_pages if num_pages is None else num_pages,
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


def size_pool(
    cfg: EngineConfig,
    model_cfg: ModelConfig,
    shard: Shard,
    draft: Draft | None = None,
    comm: MinOverRanks | None = None,
) -> EngineConfig:
    """`cfg` with the pages `--mem-fraction-static` gives the KV pool once this rank's weights are loaded
    (`mem.sizing`), the fraction then resolved to 0; `cfg` itself when the fraction is off. Every rank of an
    instance takes the fewest any of them can hold (`comm`), since the driver hands out pages valid on all."""
    cache = cfg.cache
    if not cache.mem_fraction_static:
        return cfg
    total, resident = device_memory(torch.device(cfg.device), cfg.disagg.ranks_per_node)
    page_bytes = pool_page_nbytes(cfg, model_cfg, shard, draft)
    context = cfg.max_context_len or model_cfg.max_position_embeddings
    one_request = -(-context // cache.page_size)
    fewest: Callable[[int], int] = comm.min_over_ranks if comm is not None else int
    pages = pages_for_fraction(total, resident, page_bytes, cache.mem_fraction_static, one_request, fewest)
    log.info(
        "%s %s: %d KV pages (%d tokens, %.2f GiB) beside %.2f GiB held, of %.2f GiB",
        FLAG,
        cache.mem_fraction_static,
        pages,
        pages * cache.page_size,
        pages * page_bytes / 2**30,
        resident / 2**30,
        total / 2**30,
    )
    return dataclasses.replace(cfg, cache=dataclasses.replace(cache, num_pages=pages, mem_fraction_static=0.0))


def device_memory(device: torch.device, ranks_here: int = 1) -> tuple[int, int]:
    """The memory the fraction is of, and the bytes of it already held. A GPU: its whole memory, and what is
    not free on it (the weights, the CUDA context, any other process: SGLang's reckoning), after torch's
    cache of freed blocks is emptied. A CPU: the machine's memory (`mem.sizing.host_memory`) shared by the
    `ranks_here` ranks of this pod, and this process's resident set."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    if device.type == "cpu":
        return host_memory() // max(1, ranks_here), process_resident()
    raise ConfigError(f"{FLAG} sizes the KV pool on a cuda or cpu device, not {device}: pass --max-total-tokens")


def pool_page_nbytes(cfg: EngineConfig, model_cfg: ModelConfig, shard: Shard, draft: Draft | None = None) -> int:
    """Bytes one page costs over every KV buffer of this rank: each of its layers' K and V (or MLA latent), a
    draft's layers in the same pool, and a draft's own pool when its pages have another shape."""
    nbytes = build_kv_pool(cfg, model_cfg, shard, draft, num_pages=0).nbytes_per_page
    if draft is not None and not draft_shares_pool(draft, model_cfg, len(shard.kv_heads(model_cfg))):
        own = KVPool(
            draft.num_layers, 0, cfg.cache.page_size, draft.num_kv_heads, draft.head_dim, DTYPES[cfg.cache.kv_dtype]
        )
        nbytes += own.nbytes_per_page
    return nbytes
