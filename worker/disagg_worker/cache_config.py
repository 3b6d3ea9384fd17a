"""The KV cache's part of the configuration chain (`config.py`: EngineConfig.cache): its pages, their dtype, the
prefix cache, and the tiers under it (`tier_config.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg_api import settings as S
from disagg_worker.flags import from_flag
from disagg_worker.mem.sizing import check_fraction
from disagg_worker.tier_config import TierConfig


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = from_flag(S.PAGE_SIZE)
    num_pages: int = from_flag(S.NUM_PAGES)  # 0: derive from max_total_tokens
    max_total_tokens: int = from_flag(S.MAX_TOTAL_TOKENS)
    mem_fraction_static: float = from_flag(S.MEM_FRACTION_STATIC)  # 0: off; else num_pages is set at start-up
    kv_dtype: str = "float32"  # --kv-dtype, or --dtype without it
    enable_prefix_cache: bool = from_flag(S.DISABLE_PREFIX_CACHE, negated=True)
    tiers: TierConfig = field(default_factory=TierConfig)  # host memory and Mooncake Store under the cache

    def __post_init__(self) -> None:
        check_fraction(self.mem_fraction_static, self.num_pages)

    @property
    def total_pages(self) -> int:
        return self.num_pages or max(1, self.max_total_tokens // self.page_size)

    @property
    def capacity_tokens(self) -> int:
        return self.total_pages * self.page_size
