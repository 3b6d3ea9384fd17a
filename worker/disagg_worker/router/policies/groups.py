"""The attention group a worker with DP attention runs a request on (its /health lists `dp_loads`), beside the
policy that picked the worker: by the group policy alone (`GroupPolicy`: LOAD or ROOM, `Worker.pick_group`), or,
where the router indexes the worker's groups (cache_aware), by each group's cache as the worker was scored."""

from __future__ import annotations

from disagg_worker.router.policies.prefix import PrefixScore, Prompt
from disagg_worker.router.worker import GroupPolicy, Worker


def group_for(
    w: Worker,
    room: int,
    prompt: Prompt | None,
    *,
    local: bool = False,
    policy: GroupPolicy,
    indexed: bool,
    score: PrefixScore,
) -> tuple[int | None, int]:
    """The attention group `w` runs a request on (None: it runs one) and the prompt tokens it computes there
    (0 for a decode receiving the KV). With DP attention and an index of `w`'s groups (`indexed`): a
    prefill (group policy LOAD) takes the group with the lowest cost, uncached tokens plus this router's
    pending ones there, guarded like the workers (an idle group takes over from one with `balance_tokens`
    pending); a decode computing the prompt itself (`local`, whatever the group policy) the group holding
    most of it, as judged when it was picked; a decode receiving the KV (group policy LOAD) the least loaded
    group, then the one holding most (fewer pages to transfer). Otherwise the group policy alone."""
    loads = w.dp_loads
    receives = w.role == "decode" and not local
    if not loads or prompt is None or not indexed or (policy is not GroupPolicy.LOAD and not local):
        return w.pick_group(policy, room), 0 if receives else score.uncached(w, prompt)
    uncached = score.group_uncached(w, prompt, len(loads))
    inflight, pending = w.group_inflight, w.group_pending
    if receives:
        return min(uncached, key=lambda g: (inflight.get(g, 0), loads[g], uncached[g], g)), 0
    cost = {g: uncached[g] + pending.get(g, 0) for g in uncached}
    best = min(cost, key=lambda g: (cost[g], inflight.get(g, 0), loads[g], g))
    idle = [g for g in cost if not pending.get(g) and not inflight.get(g)]
    if idle and best not in idle and pending.get(best, 0) >= score.balance_tokens:
        moved = min(idle, key=lambda g: (cost[g], loads[g], g))
        # A prefill's `pick` counted a cache hit the request no longer gets: taken back in the same step of the
        # event loop as the pick (no await between), so a scrape of the counter never sees it go down.
        if not local and uncached[moved] >= prompt.tokens > min(uncached.values()):
            score.decisions["cache_hit"] -= 1
            score.decisions["balanced"] += 1
        best = moved
    return best, uncached[best]
