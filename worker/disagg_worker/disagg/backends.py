"""Transfer backends by config name (`DisaggConfig.transfer_backend`).

Each backend maps a role to its manager class. The classes are imported only when asked for,
so the fake backend (unit tests, `--transfer-backend fake`) runs without the Mooncake wheel.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg.base import KVLayout, KVManager, RankInfo
from disagg_worker.disagg.metrics import TransferMetrics


def _fake(role: Role) -> type[KVManager]:
    from disagg_worker.disagg.fake import FakeKVManager

    return FakeKVManager


def _mooncake(role: Role) -> type[KVManager]:
    from disagg_worker.disagg.mooncake.decode import MooncakeDecodeManager
    from disagg_worker.disagg.mooncake.prefill import MooncakePrefillManager

    return MooncakePrefillManager if role is Role.PREFILL else MooncakeDecodeManager


BACKENDS: dict[str, Callable[[Role], type[KVManager]]] = {"fake": _fake, "mooncake": _mooncake}


def manager_class(backend: str, role: Role) -> type[KVManager]:
    """The manager class of `backend` for `role`; ValueError naming the known backends."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown transfer backend {backend!r}; known: {sorted(BACKENDS)}")
    if role not in (Role.PREFILL, Role.DECODE):
        raise ValueError(f"no KV transfer for role {role.value!r}")
    return BACKENDS[backend](role)


def create_kv_manager(
    cfg: DisaggConfig,
    layout: KVLayout,
    rank: RankInfo | None = None,
    metrics: TransferMetrics | None = None,
) -> KVManager:
    """Build the manager for `cfg.role` with `cfg.transfer_backend`."""
    rank = RankInfo() if rank is None else rank
    cls = manager_class(cfg.transfer_backend, cfg.role)
    instance = f"{cfg.role.value}-tp{rank.tp_rank}-pp{rank.pp_rank}"
    return cls(cfg, layout, rank, metrics or TransferMetrics(instance))
