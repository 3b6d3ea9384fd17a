"""The attention groups of a DP-attention instance as the HTTP process sees them.

Each group has its own scheduler process (its requests, its KV pool), so the HTTP process sends each
request to one group, and merges the groups' reports into the instance's. Pure functions.

Which group takes a request (`choose_group`):
- the one the request names (`data_parallel_rank`; the router names it, by load);
- on prefill, the group the bootstrap target names (`bootstrap_dp_rank`): decode finds the KV in the group the
  router told it, so prefill never chooses by itself, and a routed request that names no group is refused
  (decode could not find its KV);
- otherwise the group with the fewest of this instance's requests in flight (ties: the lowest).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from disagg_worker.request import messages as msg


def choose_group(route: msg.Route, dp_size: int, inflight: Sequence[int], prefill: bool) -> int:
    """The group of a request (see the module docstring); `route.dp_rank` is checked by the caller."""
    if route.dp_rank is not None:
        return route.dp_rank
    b = route.bootstrap
    if prefill and b is not None and b.dp_rank is not None:
        return b.dp_rank
    return min(range(dp_size), key=lambda g: (inflight[g], g))


def group_problem(route: msg.Route, dp_size: int, prefill: bool) -> tuple[str, str]:
    """Why a request's named groups do not exist here: (the field, the message), or ("", "")."""
    named = [("data_parallel_rank", route.dp_rank)]
    if prefill and route.bootstrap is not None:  # on decode it names the prefill instance's group
        named.append(("bootstrap_dp_rank", route.bootstrap.dp_rank))
    for field, dp in named:
        if dp is not None and not 0 <= dp < dp_size:
            return field, f"{field} {dp}: this instance runs {dp_size} attention group{'s' if dp_size > 1 else ''}"
    b = route.bootstrap
    if prefill and b is not None and dp_size > 1:
        if b.dp_rank is None:
            return "bootstrap_dp_rank", (
                f"this prefill instance runs {dp_size} attention groups: a routed request names the one that holds "
                "its KV (bootstrap_dp_rank; the router sets it), or decode could not find it"
            )
        if route.dp_rank is not None and route.dp_rank != b.dp_rank:
            return "data_parallel_rank", (
                f"data_parallel_rank {route.dp_rank} differs from bootstrap_dp_rank {b.dp_rank}: on prefill both name "
                "the group that holds the request's KV"
            )
    return "", ""


def load(s: msg.SchedulerStats) -> int:
    """A group's requests: running, waiting, and in its P/D queues."""
    return s.running + s.waiting + sum(s.queues.values())


def merge_stats(parts: Mapping[int, msg.SchedulerStats]) -> msg.SchedulerStats:
    """The instance's report from its groups' latest ones (sums; queues by name; ranks as reported)."""
    if len(parts) == 1:
        return next(iter(parts.values()))
    ordered = [parts[g] for g in sorted(parts)]
    queues: dict[str, int] = {}
    ranks: dict[tuple[int, int], dict[str, int]] = {}
    for s in ordered:
        for name, n in s.queues.items():
            queues[name] = queues.get(name, 0) + n
        ranks.update(s.rank_queues)

    def total(field: str) -> int:
        return sum(getattr(s, field) for s in ordered)

    return replace(
        ordered[0],
        time=min(s.time for s in ordered),
        running=total("running"),
        waiting=total("waiting"),
        pages_used=total("pages_used"),
        pages_total=total("pages_total"),
        cache_hit_tokens=total("cache_hit_tokens"),
        cache_query_tokens=total("cache_query_tokens"),
        step_count=max(s.step_count for s in ordered),
        cache_pages=total("cache_pages"),
        cache_refs=total("cache_refs"),
        prompt_tokens_computed=total("prompt_tokens_computed"),
        pages_taken_in_flight=total("pages_taken_in_flight"),
        metrics_text=merge_exposition({g: parts[g].metrics_text for g in sorted(parts)}),
        queues=queues,
        rank_queues=ranks,
    )


def merge_exposition(texts: Mapping[int, str]) -> str:
    """The groups' Prometheus expositions as one: every sample labelled with its group (`dp_rank`), each
    family's HELP and TYPE once."""
    if len(texts) == 1:
        return next(iter(texts.values()))
    heads: dict[str, tuple[str, str]] = {}
    samples: dict[str, list[str]] = {}
    for group, text in texts.items():
        for family in text_string_to_metric_families(text):
            heads.setdefault(family.name, (family.documentation, family.type))
            lines = samples.setdefault(family.name, [])
            for s in family.samples:
                labels = {**s.labels, "dp_rank": str(group)}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{body}}} {floatToGoString(s.value)}")
    out: list[str] = []
    for name, (doc, kind) in heads.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples[name]]
    return "\n".join(out) + "\n" if out else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
