"""Transfer backends by config name (`DisaggConfig.transfer_backend`)."""

from __future__ import annotations

from collections.abc import Callable

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg.base import KVLayout, KVManager, RankInfo
from disagg_worker.disagg.metrics import TransferMetrics

# name -> role -> manager class; classes are imported lazily so the fake needs no mooncake.
_BACKENDS: dict[str, Callable[[Role], type[KVManager]]] = {}


def register_backend(name: str, resolve: Callable[[Role], type[KVManager]]) -> None:
    _BACKENDS[name] = resolve


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str, role: Role) -> type[KVManager]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; known: {backend_names()}")
    if role not in (Role.PREFILL, Role.DECODE):
        raise ValueError(f"no KV transfer for role {role.value!r}")
    return _BACKENDS[name](role)


def create_kv_manager(
    cfg: DisaggConfig,
    layout: KVLayout,
    rank: RankInfo = RankInfo(),
    metrics: TransferMetrics | None = None,
) -> KVManager:
    """Build the manager for `cfg.role` with `cfg.transfer_backend`."""
    cls = get_backend(cfg.transfer_backend, cfg.role)
    instance = f"{cfg.role.value}-tp{rank.tp_rank}-pp{rank.pp_rank}"
    return cls(cfg, layout, rank, metrics or TransferMetrics(instance))


def _fake(role: Role) -> type[KVManager]:
    from disagg_worker.disagg.fake import FakeKVManager

    return FakeKVManager


def _mooncake(role: Role) -> type[KVManager]:
    from disagg_worker.disagg.mooncake_decode import MooncakeDecodeManager
    from disagg_worker.disagg.mooncake_prefill import MooncakePrefillManager

    return MooncakePrefillManager if role is Role.PREFILL else MooncakeDecodeManager


register_backend("fake", _fake)
register_backend("mooncake", _mooncake)
