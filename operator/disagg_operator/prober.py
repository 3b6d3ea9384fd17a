"""The operator's clock: every few seconds, read `/health` of every router pod and recompute each CR's status.

Router pods are reached at their pod IPs (not through the router Service, which lists only Ready pods: a router
with no verified pair is exactly the one whose report matters). This needs the operator inside the cluster
network; from outside, every probe fails fast and routerview.py reports what readiness alone says. The same tick
re-evaluates rollout deadlines, so a stalled rollout is reported even when nothing else changes. Probing reads no
API object and status is written only on a change: an idle operator makes no API writes.
"""

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from . import names
from .probe_auth import ProbeTokens
from .reconcile import Runtime
from .routerview import RouterView, merge_reports

log = logging.getLogger(__name__)
MISSES_BEFORE_FORGETTING = 3


async def fetch_health(session: aiohttp.ClientSession, ip: str, token: str = "") -> dict | None:
    """A router pod's /health report (it answers 503 with the same body when it has no verified pair); `token`
    (probe_auth.py) shows the details to the operator when the router has API keys."""
    host = f"[{ip}]" if ":" in ip else ip
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.get(f"http://{host}:{names.HTTP_PORT}/health", headers=headers) as r:
            body = json.loads(await r.read())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


async def read_routers(
    targets: Mapping[str, Mapping[str, str]], timeout_s: float, tokens: Mapping[str, str] | None = None
) -> dict[str, dict]:
    """uid -> {router pod: report or None}, every pod probed at once (with the CR's token, when known)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)
    tokens = tokens or {}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        keys = [(uid, pod) for uid, pods in targets.items() for pod in pods]
        answers = await asyncio.gather(
            *(fetch_health(session, targets[uid][pod], tokens.get(uid, "")) for uid, pod in keys)
        )
    out: dict[str, dict] = {uid: {} for uid in targets}
    for (uid, pod), answer in zip(keys, answers, strict=True):
        out[uid][pod] = answer
    return out


def keep_or_replace(old: RouterView | None, new: RouterView, misses: dict[str, int], uid: str) -> RouterView | None:
    """The view to report: the new one, unless no router answered and one did shortly before (a router busy for a
    moment must not flip the status between detailed and readiness-only, which would cost a write each time)."""
    if new.reached:
        misses.pop(uid, None)
        return new
    misses[uid] = misses.get(uid, 0) + 1
    if old is not None and old.reached and misses[uid] < MISSES_BEFORE_FORGETTING:
        return old
    return None if not new.probed else new


def take_reports(runtime: Runtime, reports: Mapping[str, Mapping[str, Any]], misses: dict[str, int]) -> None:
    """Merge each model's reports into its view, one model at a time: a report that fails to merge (parsing is
    total, so this is a bug) is logged and leaves the other models' views current."""
    for uid, by_pod in reports.items():
        try:
            if (model := runtime.known(uid)) is not None:  # not forgotten meanwhile
                model.view = keep_or_replace(model.view, merge_reports(by_pod), misses, uid)
        except Exception:
            log.exception("merging the router reports of %s failed", uid)


async def run(runtime: Runtime) -> None:
    """Until cancelled: probe the routers (when enabled), then tick every known CR in a worker thread."""
    cfg = runtime.cfg
    misses: dict[str, int] = {}
    tokens = ProbeTokens(runtime.kube)
    while True:
        await asyncio.sleep(cfg.tick_s)
        try:
            if cfg.router_probe:
                targets = runtime.router_pods()  # only the pods the model's router Deployment created
                crs = {uid: i.cr for uid, i in runtime.latest_inputs().items() if targets.get(uid)}
                known = await asyncio.to_thread(tokens.for_crs, crs)
                reports = await read_routers(targets, cfg.router_probe_timeout_s, known)
                for uid, by_pod in reports.items():  # a plain answer to a token: a stale token (a new Secret)
                    if uid in known and any(r is not None and "workers" not in r for r in by_pod.values()):
                        tokens.forget(crs[uid])
                take_reports(runtime, reports, misses)
        except Exception:  # one failed round must not stop the clock
            log.exception("reading the router pods failed")
        context = runtime.handler_context
        if context is None:  # no handler has run yet: no CR is known either
            continue
        for uid in runtime.latest_inputs():
            try:
                await asyncio.to_thread(context.copy().run, runtime.tick, uid)
            except Exception:  # one CR's failure must not hold up the others
                log.exception("periodic status refresh of %s failed", uid)
