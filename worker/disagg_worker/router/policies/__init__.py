"""Routing policies by name (`--policy`): how the router picks the prefill and the decode of a request.

A policy is handed the candidates of one role (`WorkerPool` keeps the workers and leaves out the unhealthy and
the excluded ones: the list is never empty) and the request's prompt (None when the router did not read it, and
for readiness checks), and picks one; it also says which workers' prefix caches the router indexes for it. It
scores only what it is handed (`Worker`'s figures, the `Prompt`, the index in `PrefixScore`): no HTTP, no
router, so the same objects can serve another front end (a Gateway API endpoint picker) over the same workers.

- `round_robin.py`: each role's workers in turn.
- `least_load.py`: the fewest requests held, then the least KV in use.
- `cache_aware.py`: prefill by the prompt tokens it would compute plus those it has pending, decode by least
  load; conditional disaggregation (decode computing a prompt itself) with it.
- `groups.py`: under DP attention, the attention group a picked worker runs the request on.
- `prefix.py`: the prompt's pages and what a worker's cache saves of them.

A new policy is one new file plus its registration. The file holds a class with the three methods of
`RoutingPolicy` (a dataclass keeping whatever state it needs: round robin's turns, cache_aware's `PrefixScore`);
the registration is its name in three places that must agree, as `tests/unit/test_routing_policies.py`
checks: in `disagg_api.router_settings.POLICIES`, which declares the flag's choices and the CRD's enum (the
operator builds those without the worker), as a `Policy` member, and in `POLICIES` below, with the factory that
builds it from the pool's `PrefixScore` (the index, cache_aware's knobs and the counter of its choices, which a
policy that needs none of them ignores).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol

from disagg_worker.router.policies.cache_aware import CacheAware
from disagg_worker.router.policies.least_load import LeastLoad
from disagg_worker.router.policies.prefix import PrefixScore, Prompt
from disagg_worker.router.policies.round_robin import RoundRobin
from disagg_worker.router.worker import Worker


class Policy(str, Enum):
    """The policies' names (the values of `--policy`); what each does is its module's."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    CACHE_AWARE = "cache_aware"


class RoutingPolicy(Protocol):
    def indexed(self, w: Worker) -> bool:
        """The router keeps an index of `w`'s prefix cache for this policy (it fetches `w`'s /kv_events with
        each health round)."""
        ...

    def pick(self, role: str, candidates: list[Worker], prompt: Prompt | None) -> Worker:
        """One of `candidates` ("prefill" or "decode" workers, healthy, never empty) for a request with `prompt`
        (None: not read, or a readiness check, which must not count as a request's choice)."""
        ...

    def decode_only(self, d: Worker, prompt: Prompt | None) -> bool:
        """The decode `pick` chose computes `prompt` itself and no prefill takes part (conditional
        disaggregation); False for a policy without it."""
        ...


POLICIES: dict[str, Callable[[PrefixScore], RoutingPolicy]] = {
    Policy.ROUND_ROBIN.value: lambda score: RoundRobin(),
    Policy.LEAST_LOAD.value: lambda score: LeastLoad(),
    Policy.CACHE_AWARE.value: CacheAware,
}


def make_policy(name: str, score: PrefixScore) -> RoutingPolicy:
    """The policy `name` over `score`; ValueError naming the known policies."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name](score)
