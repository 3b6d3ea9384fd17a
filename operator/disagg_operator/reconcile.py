"""What one reconcile does: apply the children, step a rollout, keep the RoleScaler in step, and write the status
if (and only if) it changed.

Reconciling is level-triggered: the desired children are rebuilt from the CR every time and server-side applied,
with the worker StatefulSets' partitions from the rollout planner (rollout.py), which reads only what the watch
indexes hold. Status is recomputed from the indexes (StatefulSets, the router Deployment, pods) plus the latest
router reports (prober.py), so refreshing it reads nothing from the API server and writes only on a change.
"""

import contextvars
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import builders, names
from .apply import Kube
from .apply_errors import ReconcileError, describe_api_error, not_ours, owned_by
from .config import OperatorConfig
from .gateway_step import reconcile_gateway
from .model_state import Inputs, ModelState, Observed
from .observe import OwnerLink, PodInfo
from .prune import prune
from .rollout import RolloutPlan, given_up, plan_rollout, with_leader_counts
from .router_trust import router_targets
from .routerview import verified_pairs
from .scaling import ScalerObservation, sync_scaler
from .spec import ModelSpec
from .status import (
    Event,
    Findings,
    PodProblem,
    compute_status,
    latch_problems,
    settled_roles,
    status_changed,
    transitions,
)

log = logging.getLogger(__name__)

EventSink = Callable[[Mapping[str, Any], Event], None]
UNTRUSTED_ROUTERS = "pods labelled as the router but not created by its Deployment are not probed: "


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Runtime:
    """Process-wide operator state shared by all handlers: the client, each CR's own state (model_state.py; by
    uid, so a recreated CR starts fresh), the namespaces seen terminating and the uids of deleted CRs."""

    kube: Kube
    cfg: OperatorConfig
    post_event: EventSink
    models: dict[str, ModelState] = field(default_factory=dict)  # uid -> that CR's state
    terminating: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)  # uids of deleted CRs (a uid is never reused)
    # A copy of a kopf handler's context (it holds kopf's event queue), for the clock's ticks to run in.
    handler_context: contextvars.Context | None = None
    _hashes: dict[str, dict[str, str]] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)  # over `models` itself (the clock reads it)

    def model(self, uid: str) -> ModelState:
        """The CR's state, made empty the first time the CR is seen. A forgotten CR's is made afresh for each
        caller and kept nowhere: a handler still running for a deleted CR leaves nothing behind."""
        with self._guard:
            if uid in self.gone and uid not in self.models:
                return ModelState()
            return self.models.setdefault(uid, ModelState())

    def locked(self, uid: str) -> threading.RLock:
        """The lock that serialises everything the operator does for one CR: hold it while reading the indexes
        and acting on them, so that no handler acts on an older view after another acted on a newer one."""
        return self.model(uid).lock

    def forget(self, uid: str) -> None:
        """The CR was deleted: drop what is kept for it, and ignore handlers still running for it."""
        with self._guard:
            self.gone.add(uid)
            self.models.pop(uid, None)

    def known(self, uid: str) -> ModelState | None:
        """The CR's state if the operator has any (None: never seen, or forgotten); makes none."""
        with self._guard:
            return self.models.get(uid)

    def latest_inputs(self) -> dict[str, Inputs]:
        """uid -> the latest inputs of every CR that has some (a copy: the clock reads it beside the handlers)."""
        with self._guard:
            models = list(self.models.items())
        return {uid: m.inputs for uid, m in models if m.inputs is not None}

    def ensure_auth_secret(self, spec: ModelSpec, m: ModelState) -> None:
        ref = spec.api_key_secret
        if ref and self.kube.get("v1", "Secret", spec.namespace, ref.name) is None:
            raise ReconcileError(f"API key Secret {ref.name} not found (it needs the key '{ref.key}')", permanent=False)
        if spec.auth_secret:
            if self.kube.get("v1", "Secret", spec.namespace, spec.auth_secret) is None:
                raise ReconcileError(
                    f"auth Secret {spec.auth_secret} not found (it needs the key '{names.AUTH_TOKEN_KEY}')",
                    permanent=False,
                )
            return
        secret = builders.build_auth_secret(spec, builders.new_token())
        try:
            if not self.kube.create_if_absent(secret):  # one of this name was there: is it this model's?
                self._check_ours(spec, m, secret)
        except ApiException as e:
            raise self._failed(spec, secret, e) from e

    def hashes(self, spec: ModelSpec) -> dict[str, str]:
        """The worker templates' hashes (remembered per spec: every event of a CR asks for them)."""
        key = repr(spec)
        if key not in self._hashes:
            if len(self._hashes) > 4096:
                self._hashes.clear()
            self._hashes[key] = {
                role: builders.template_hash(builders.worker_pod_template(spec, role, self.cfg))
                for role in names.WORKER_ROLES
            }
        return self._hashes[key]

    def plan(
        self,
        spec: ModelSpec,
        m: ModelState,
        observed: Observed,
        pods: Iterable[PodInfo],
        status: Mapping[str, Any] | None,
    ) -> RolloutPlan:
        """The rollout's next step for the CR whose state is `m`; `status` is the CR's (a surge given up before
        stays given up)."""
        revision = builders.pairing_revision(spec)
        written = (m.written or status or {}).get("rollout")
        gave_up = m.in_place.get(revision) or given_up(written, revision)
        verified = verified_pairs(m.view, revision)
        plan = plan_rollout(spec, observed, pods, self.hashes(spec), time.time(), gave_up, verified)
        if plan.in_place and plan.active:
            m.in_place[revision] = plan.in_place
        else:  # over: a later rollout (of the same pairing revision too) tries its own surge
            m.in_place.pop(revision, None)
        return plan

    def _partitions(self, spec: ModelSpec, m: ModelState, plan: RolloutPlan) -> dict[str, int]:
        """The plan's partitions, never above one already applied for the same template; remembered."""
        out = {}
        for role, template in self.hashes(spec).items():
            before = m.partitions.get(role)
            partition = plan.partitions[role]
            if before is not None and before[0] == template:
                partition = min(partition, before[1])
            m.partitions[role] = (template, partition)
            out[role] = partition
        return out

    def _failed(self, spec: ModelSpec, obj: Mapping[str, Any], e: ApiException) -> ReconcileError:
        if e.status == 403 and b"being terminated" in (e.body or b""):
            self.terminating.add(spec.namespace)
        return describe_api_error(obj, e)

    def _ours(self, spec: ModelSpec, m: ModelState, obj: Mapping[str, Any]) -> bool:
        """False when an object with `obj`'s name exists and is not this model's (it is then never written)."""
        key = (obj["kind"], obj["metadata"]["name"])
        if key in m.owned:
            return True
        found = self.kube.get(obj["apiVersion"], obj["kind"], spec.namespace, obj["metadata"]["name"])
        if found is not None and not owned_by(found, spec):
            return False
        m.owned.add(key)
        return True

    def _check_ours(self, spec: ModelSpec, m: ModelState, obj: Mapping[str, Any]) -> None:
        if not self._ours(spec, m, obj):
            raise not_ours([obj])

    def _apply(self, spec: ModelSpec, m: ModelState, objs: Iterable[Mapping[str, Any]]) -> None:
        """Server-side apply each of `objs`, except those whose name another object holds (then reported)."""
        foreign = []
        for obj in objs:
            try:
                if not self._ours(spec, m, obj):
                    foreign.append(obj)
                    continue
                self.kube.apply(obj)
                m.pruned.discard((obj["kind"], obj["metadata"]["name"]))
            except ApiException as e:
                raise self._failed(spec, obj, e) from e
        if foreign:
            raise not_ours(foreign)

    def apply_children(
        self,
        cr: Mapping[str, Any],
        observed: Observed | None = None,
        pods: Iterable[PodInfo] = (),
        workers: bool = True,
        others: bool = True,
    ) -> None:
        """Create or update the children of `cr` (the worker StatefulSets, the `others`, or both) and, with the
        others, delete those the spec retired; records (and raises) the first failure. The others need no
        observation, so a caller may apply them without holding the CR's lock. Without `observed` (no StatefulSet
        seen yet) the worker StatefulSets get partition 0."""
        spec = ModelSpec.from_cr(cr)
        m = self.model(spec.uid)
        try:
            if others:
                self.ensure_auth_secret(spec, m)
            plan = self.plan(spec, m, observed or {}, pods, cr.get("status"))
            partitions = self._partitions(spec, m, plan) if workers else {}
            children = builders.build_children(spec, self.cfg, partitions, plan.surges)
            worker_sets = {builders.worker_set_name(spec, r) for r in names.WORKER_ROLES}
            kinds = ("StatefulSet", names.LWS_KIND)
            self._apply(
                spec,
                m,
                [
                    c
                    for c in children
                    if (workers if c["kind"] in kinds and c["metadata"]["name"] in worker_sets else others)
                ],
            )
            if others:
                prune(self.kube, spec, builders.retired_children(spec), m.pruned, m.owned)
                reconcile_gateway(partial(self._apply, spec, m), self.kube, self.cfg, cr, spec, m, self.post_event)
        except ReconcileError as e:
            m.errors = [str(e)]
            raise
        m.errors = []
        self.terminating.discard(spec.namespace)

    def step_rollout(self, cr: Mapping[str, Any], observed: Observed, pods: Iterable[PodInfo]) -> list[str]:
        """Apply the worker StatefulSets whose partition or surge the planner moved; returns the roles applied."""
        spec = ModelSpec.from_cr(cr)
        m = self.model(spec.uid)
        plan = self.plan(spec, m, observed, pods, cr.get("status"))
        partitions, surges = self._partitions(spec, m, plan), plan.surges
        moved = [
            role
            for role in names.WORKER_ROLES
            if (obs := observed.get(role)) is not None
            and (partitions[role] != obs.partition or obs.desired not in (None, plan.replicas[role]))
        ]
        self._apply(spec, m, [builders.build_worker_set(spec, r, self.cfg, partitions[r], surges[r]) for r in moved])
        return moved

    def sync_scaler(
        self,
        cr: Mapping[str, Any],
        scaler: ScalerObservation | None,
        current_replicas: int | None,
        recreate: bool = False,
    ) -> None:
        """Create prefill's RoleScaler once (again after `recreate`: it was deleted), then keep it and the CR in
        step (scaling.py). Each write is made once per scaler generation: the index may not show it yet."""
        spec = ModelSpec.from_cr(cr)
        if cr["metadata"].get("deletionTimestamp") or spec.namespace in self.terminating:
            return
        sent = self.model(spec.uid).scaler_sent
        if recreate:
            sent.clear()
        name = builders.scaler_name(spec, names.PREFILL)
        try:
            if scaler is None:
                if "created" not in sent:
                    self.kube.create_if_absent(builders.build_role_scaler(spec, names.PREFILL))
                    sent["created"] = True
                return
            sync = sync_scaler(spec, scaler, current_replicas)
            writes: list[tuple[str, str, dict[str, Any]]] = []
            if sync.model_replicas is not None:
                writes.append((names.KIND, spec.name, {"spec": {"prefill": {"replicas": sync.model_replicas}}}))
            if sync.scaler_replicas is not None:
                writes.append((names.SCALER_KIND, name, {"spec": {"replicas": sync.scaler_replicas}}))
            for kind, obj, body in writes:
                if sent.get(kind) != (scaler.generation, body):
                    self.kube.patch(kind, spec.namespace, obj, body)
                    sent[kind] = (scaler.generation, body)
            if sync.scaler_status is not None and sent.get("status") != sync.scaler_status:
                self.kube.patch_status(spec.namespace, name, sync.scaler_status, kind=names.SCALER_KIND)
                sent["status"] = sync.scaler_status
        except ApiException as e:
            if e.status == 404:  # the model or the scaler went away meanwhile; its deletion is handled elsewhere
                return
            raise ReconcileError(f"syncing RoleScaler {name} failed ({e.status} {e.reason})", permanent=False) from e

    def refresh_status(
        self,
        cr: Mapping[str, Any],
        observed: Observed,
        problems: Iterable[PodProblem],
        pods: Iterable[PodInfo] = (),
        links: Iterable[OwnerLink] = (),
    ) -> bool:
        """Write the CR's status when it differs from the last one written; post an Event per transition."""
        spec = ModelSpec.from_cr(cr)
        inputs = Inputs(cr, observed, tuple(problems), tuple(pods), tuple(links))
        m = self.model(spec.uid)
        with m.lock:
            if spec.uid in self.gone:  # a handler that started before the CR's deletion: nothing to report
                return False
            m.inputs = inputs
            return self._refresh(spec, m, inputs)

    def refresh_cached(self, uid: str) -> bool:
        """Recompute a CR's status from its latest inputs (time passed, or the router view changed)."""
        m = self.known(uid)
        if m is None:
            return False
        with m.lock:
            inputs = m.inputs
            return self._refresh(ModelSpec.from_cr(inputs.cr), m, inputs) if inputs else False

    def _refresh(self, spec: ModelSpec, m: ModelState, inputs: Inputs) -> bool:
        cr, observed = inputs.cr, with_leader_counts(spec, inputs.observed, inputs.pods)
        refused = router_targets(spec.uid, spec.name, inputs.pods, inputs.links).refused
        if refused and refused != m.refused:
            self.post_event(cr, Event("Warning", "RouterPodRefused", UNTRUSTED_ROUTERS + ", ".join(refused)))
        m.refused = refused
        m.latched = latch_problems(m.latched, inputs.problems, settled_roles(spec, observed))
        previous = m.written or cr.get("status") or {}
        findings = Findings(
            self.plan(spec, m, observed, inputs.pods, cr.get("status")),
            builders.pairing_revision(spec),
            m.view,
            tuple(m.gateway_errors),
        )
        new = compute_status(
            spec,
            cr["metadata"].get("generation", 0),
            observed,
            sorted(m.latched.values(), key=lambda p: p.pod),
            m.errors,
            previous,
            builders.router_endpoint(spec),
            now(),
            findings,
        )
        if not status_changed(previous, new):
            return False
        try:
            self.kube.patch_status(spec.namespace, spec.name, new)
        except ApiException as e:
            if e.status == 404:  # deleted meanwhile: nothing left to report on, nor to tick
                self.gone.add(spec.uid)
                m.inputs = None
                return False
            raise
        m.written = new
        for event in transitions(previous.get("conditions") or [], new["conditions"]):
            self.post_event(cr, event)
        return True

    def tick(self, uid: str) -> None:
        """Time passed (or the router view changed): step the rollout if it may move, recompute the status."""
        m = self.known(uid)
        if m is None:
            return
        with m.lock:
            inputs = m.inputs
            if inputs is None:
                return
            try:
                self.step_rollout(inputs.cr, inputs.observed, inputs.pods)
            except ReconcileError as e:  # the next event or tick retries
                log.warning("stepping the rollout of %s: %s", inputs.cr["metadata"]["name"], e)
            self.refresh_cached(uid)

    def router_pods(self) -> dict[str, dict[str, str]]:
        """uid -> {router pod name: pod IP} for every CR, of the router pods its Deployment created that have an
        address (router_trust.py): no other pod is probed or shown the model's health token."""
        return {
            uid: router_targets(uid, i.cr["metadata"]["name"], i.pods, i.links).probe
            for uid, i in self.latest_inputs().items()
        }

    def cr_is_live(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the CR still exists and is not being deleted (read fresh, not from a cache)."""
        current = self.kube.get(names.API_VERSION, names.KIND, namespace, name)
        return bool(
            current and current["metadata"].get("uid") == uid and not current["metadata"].get("deletionTimestamp")
        )
