"""The planner's clock: for each model whose `spec.scaling.planner.mode` is Advisory or Apply, every
`correctionIntervalSeconds` (on the operator's tick), scrape its worker pods' /metrics, derive the interval's
observations (planner/scrape.py), decide (planner.plan), report in `status.planner` and an Event when the
recommendation changes (planner_report.py), and in Apply write the replicas through the existing scale paths.

A model without a planner block costs nothing here: it is skipped before any read. The status is written only
when what it says changes, so an idle model with a planner makes no API writes either.

Apply writes decode's replicas into the DisaggregatedModel (its scale subresource's field) and prefill's into its
RoleScaler (scaling.py hands them on to the model), never a role whose scale subresource an HPA targets (that role
stays advisory, and `status.planner.advisoryRoles` names it). The core decides what may be written during a
rollout (nothing shrinks while one surges).
"""

import asyncio
import base64
import hashlib
import hmac
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes.client.exceptions import ApiException

from . import builders, names
from .model_state import Inputs
from .planner import plan
from .planner.constraints import Recommendation
from .planner.from_cr import capacity_model, decision_interval_s, planner_spec
from .planner.inputs import Mode, PlannerSpec, Replicas
from .planner.scrape import Scrape, derive, parse_metrics
from .planner_report import next_status, planner_content, recommendation_event, scale_writes
from .reconcile import Runtime, now
from .spec import ModelSpec

log = logging.getLogger(__name__)
WORKER_TOKEN = "worker-http"  # equal to disagg_worker.keys.WORKER: the key workers accept from the router
NO_PROFILE = "no profile (spec.scaling.planner.profile) and no per-step records from the workers"


@dataclass
class Track:
    """What the planner keeps for one model between its decisions (in memory; a restarted operator starts over
    from the status it wrote)."""

    last: Scrape | None = None
    history: tuple[Recommendation, ...] = ()
    next_at: float = 0.0
    written: dict | None = None  # the status.planner last written
    sent: tuple | None = None  # (generation, writes) last sent in Apply


@dataclass
class PlannerLoop:
    runtime: Runtime
    tracks: dict[str, Track] = field(default_factory=dict)
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)

    def due(self, at: float) -> dict[str, tuple[Inputs, PlannerSpec]]:
        """The models with a planner whose interval has passed; forgets the others."""
        out = {}
        latest = self.runtime.latest_inputs()
        for uid, inputs in latest.items():
            pspec = planner_spec(inputs.cr.get("spec") or {})
            if pspec is None:
                self.tracks.pop(uid, None)
                continue
            track = self.tracks.setdefault(uid, Track())
            if at >= track.next_at:
                # Half a tick early counts as due: the tick that lands just short of the interval does not wait
                # for a whole further tick.
                track.next_at = at + decision_interval_s(inputs.cr["spec"]) - self.runtime.cfg.tick_s / 2
                out[uid] = (inputs, pspec)
        for uid in set(self.tracks) - set(latest):
            self.tracks.pop(uid)
        return out

    def worker_token(self, spec: ModelSpec) -> str:
        """With API keys set, workers protect /metrics: the key they accept from the router, derived from the
        model's shared secret (read once)."""
        if spec.api_key_secret is None:
            return ""
        key = (spec.namespace, spec.auth_secret_name)
        if key not in self.tokens:
            try:
                secret = self.runtime.kube.get("v1", "Secret", spec.namespace, spec.auth_secret_name) or {}
            except ApiException:
                return ""
            data = (secret.get("data") or {}).get(names.AUTH_TOKEN_KEY)
            if not data:
                return ""
            shared = base64.b64decode(data).decode().strip()
            self.tokens[key] = hmac.new(shared.encode(), WORKER_TOKEN.encode(), hashlib.sha256).hexdigest()
        return self.tokens[key]

    def hpa_roles(self, spec: ModelSpec) -> tuple[str, ...]:
        """The roles whose scale subresource an HPA in the model's namespace targets."""
        try:
            found = self.runtime.kube.list("autoscaling/v2", "horizontalpodautoscalers", spec.namespace)
        except ApiException as e:
            log.warning("listing HPAs in %s failed (%s): Apply stays advisory there", spec.namespace, e.status)
            return names.WORKER_ROLES
        return hpa_owned((found or {}).get("items") or [], spec.name, builders.scaler_name(spec, names.PREFILL))

    def decide(self, uid: str, inputs: Inputs, pspec: PlannerSpec, scrape: Scrape) -> None:
        """One decision for one model, under its lock; runs in a worker thread in a handler's context (Events)."""
        m = self.runtime.known(uid)
        track = self.tracks.get(uid)
        if m is None or track is None:
            return
        with m.lock:
            cr = inputs.cr
            spec = ModelSpec.from_cr(cr)
            obs, why = derive(track.last, scrape, pspec.slo.percentile)
            track.last = scrape
            model = capacity_model(cr["spec"])
            current = Replicas(spec.replicas(names.PREFILL), spec.replicas(names.DECODE))
            rolling = bool((m.written or cr.get("status") or {}).get("rollout"))
            decision = plan(obs, model, pspec, current, rolling, track.history, scrape.at_s)
            track.history = decision.history
            advisory = self.hpa_roles(spec) if pspec.mode is Mode.APPLY else ()
            if model is None:
                why = f"{why}; {NO_PROFILE}"
            content = planner_content(pspec.mode, decision, current, why, advisory)
            previous = track.written or (cr.get("status") or {}).get("planner")
            new = next_status(previous, content, now())
            if new is not None:
                try:
                    self.runtime.kube.patch_status(spec.namespace, spec.name, {"planner": new})
                except ApiException as e:
                    if e.status != 404:
                        raise
                    return
                track.written = new
                event = recommendation_event(previous, content)
                if event is not None:
                    self.runtime.post_event(cr, event)
            if pspec.mode is Mode.APPLY:
                self.apply(
                    spec, cr, track, scale_writes(decision.writes, current, advisory, bool(spec.prefill_per_decode))
                )

    def apply(self, spec: ModelSpec, cr: Mapping[str, Any], track: Track, writes: dict[str, int]) -> None:
        """Write each role's replicas once per generation of the model (the index may not show a write yet)."""
        sent = (cr["metadata"].get("generation"), tuple(sorted(writes.items())))
        if not writes or track.sent == sent:
            return
        for role, n in writes.items():
            try:
                if role == names.DECODE:
                    self.runtime.kube.patch(
                        names.KIND, spec.namespace, spec.name, {"spec": {"decode": {"replicas": n}}}
                    )
                else:
                    scaler = builders.scaler_name(spec, names.PREFILL)
                    self.runtime.kube.patch(names.SCALER_KIND, spec.namespace, scaler, {"spec": {"replicas": n}})
            except ApiException as e:
                log.warning("planner: writing %s replicas of %s failed (%s)", role, spec.name, e.status)
                return
        track.sent = sent


def hpa_owned(hpas: list[Mapping[str, Any]], model: str, scaler: str) -> tuple[str, ...]:
    """The roles whose scale subresource one of `hpas` targets: decode the model's, prefill its RoleScaler's."""
    roles = set()
    for hpa in hpas:
        ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if ref.get("kind") == names.KIND and ref.get("name") == model:
            roles.add(names.DECODE)
        if ref.get("kind") == names.SCALER_KIND and ref.get("name") == scaler:
            roles.add(names.PREFILL)
    return tuple(r for r in names.WORKER_ROLES if r in roles)


async def fetch_metrics(session: aiohttp.ClientSession, ip: str, token: str) -> dict[str, float] | None:
    host = f"[{ip}]" if ":" in ip else ip
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.get(f"http://{host}:{names.HTTP_PORT}/metrics", headers=headers) as r:
            if r.status != 200:
                return None
            return parse_metrics((await r.read()).decode(errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


async def scrape(inputs: Inputs, token: str, timeout_s: float, probe: bool) -> Scrape:
    """Every worker pod of the model with an address, at once; those that answered, by role."""
    pods = [p for p in inputs.pods if p.role in names.WORKER_ROLES and p.ip and not p.terminating]
    if not probe:  # the operator cannot reach pods (it runs outside the cluster network)
        return Scrape(time.time(), asked=len(pods))
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        answers = await asyncio.gather(*(fetch_metrics(session, p.ip, token) for p in pods))
    at = time.time()
    by_role: dict[str, dict[str, Mapping[str, float]]] = {r: {} for r in names.WORKER_ROLES}
    for pod, answer in zip(pods, answers, strict=True):
        if answer is not None:
            by_role[pod.role][pod.name] = answer
    return Scrape(at, by_role[names.PREFILL], by_role[names.DECODE], len(pods))


async def run(runtime: Runtime) -> None:
    """Until cancelled: on each tick, decide for the models whose planner is due."""
    loop = PlannerLoop(runtime)
    cfg = runtime.cfg
    while True:
        await asyncio.sleep(cfg.tick_s)
        context = runtime.handler_context
        if context is None:
            continue
        for uid, (inputs, pspec) in loop.due(time.time()).items():
            try:
                spec = ModelSpec.from_cr(inputs.cr)
                token = await asyncio.to_thread(loop.worker_token, spec)
                got = await scrape(inputs, token, cfg.router_probe_timeout_s, cfg.router_probe)
                await asyncio.to_thread(context.copy().run, loop.decide, uid, inputs, pspec, got)
            except Exception:  # one model's failure must not stop the others' planning
                log.exception("planning %s failed", uid)
