"""kopf handlers: they read, call the builders, apply, and report. No decisions live here.

Watches: the DisaggregatedModels, their RoleScalers, and every object labelled
`app.kubernetes.io/managed-by=disagg-operator` (StatefulSets, Deployments, Services, PodDisruptionBudgets,
NetworkPolicies, Pods). A child's event maps to its parent through the `disagg.dev/model` label; an idle cluster
produces no events and so no writes. A background task (prober.py) reads the router pods' /health and ticks the
status of every CR every few seconds; it too writes only on a change.
"""

import asyncio
import contextvars
import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

import kopf

from . import names, planner_loop, prober
from .apply import Kube, load_client
from .apply_errors import ReconcileError
from .config import OperatorConfig
from .observe import OwnerLink, PodInfo, observe_group_set, observe_link, observe_pod
from .reconcile import Runtime
from .scaling import ScalerObservation, observe_scaler
from .status import Event, PodProblem, RoleObservation, observe_workload, pod_problem

MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
logger = logging.getLogger(__name__)
WORKERS = 16
# A model whose gateway objects could not be applied (a CRD not installed yet) is reconciled again this often.
GATEWAY_RETRY_S = 30
CR = (names.GROUP, names.VERSION, names.PLURAL)
SCALERS = (names.GROUP, names.VERSION, names.SCALER_PLURAL)
CHILD_KINDS = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    (names.LWS_GROUP, "v1", names.LWS_PLURAL),  # served only where LWS is installed: kopf waits for its CRD
]


def post_event(cr: Mapping[str, Any], event: Event) -> None:
    """Post through kopf's event queue. Its context exists in handlers; the clock runs ticks in a copy of a
    handler's context (`Runtime.handler_context`), so a tick can post too."""
    body = kopf.Body(cast(kopf.RawBody, dict(cr)))  # the CR as read from the API server: a raw body
    try:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)
    except LookupError:  # outside any handler's context: the status carries the news anyway
        logger.warning("no event queue to post %s %s for %s", event.type, event.reason, cr["metadata"]["name"])


def _remember_context(runtime: Runtime) -> None:
    if runtime.handler_context is None:
        runtime.handler_context = contextvars.copy_context()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{names.GROUP}/finalizer"
    # How long kopf waits to see its own annotation patch before it trusts an older body of the CR. On a busy API
    # server the echo can take longer than the default 5 s; an older body (say, from a status write) then looks
    # unhandled and the creation handler runs twice.
    settings.persistence.consistency_timeout = 30
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = WORKERS
    memo.runtime = Runtime(Kube(load_client(pool_size=2 * WORKERS)), OperatorConfig.from_env(), post_event)
    memo.clock = asyncio.create_task(prober.run(memo.runtime))
    memo.planner = asyncio.create_task(planner_loop.run(memo.runtime))  # does nothing for a model without one


@kopf.on.cleanup()
async def stop_clock(memo: kopf.Memo, **_: Any) -> None:
    memo.clock.cancel()
    memo.planner.cancel()


def _plain(body: kopf.Body) -> dict[str, Any]:
    return copy.deepcopy({k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")})


def _key(namespace: str | None, labels: Mapping[str, str]) -> tuple:
    return (namespace, labels.get(names.MODEL_LABEL))


@kopf.index(*CR)
def models(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): _plain(body)}


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
def worker_sets(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {_key(namespace, labels): (labels.get(names.ROLE_LABEL), observe_workload(body))}


@kopf.index(names.LWS_GROUP, "v1", names.LWS_PLURAL, labels=MANAGED)
def group_sets(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {_key(namespace, labels): (labels.get(names.ROLE_LABEL), observe_group_set(body))}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def router_sets(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {_key(namespace, labels): (labels.get(names.ROLE_LABEL), observe_workload(body))}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def deployment_links(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {_key(namespace, labels): observe_link(body)}


@kopf.index("apps", "v1", "replicasets", labels=MANAGED)
def replica_set_links(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    """The router Deployment's ReplicaSets (they carry its pod template's labels): who created a router pod."""
    return {_key(namespace, labels): observe_link(body)}


@kopf.index("", "v1", "pods", labels=MANAGED)
def failing_pods(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict | None:
    problem = pod_problem(body)
    return {_key(namespace, labels): problem} if problem else None


@kopf.index("", "v1", "pods", labels=MANAGED)
def pod_infos(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {_key(namespace, labels): observe_pod(body)}


@kopf.index(*SCALERS, labels=MANAGED)
def scalers(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {_key(namespace, labels): observe_scaler(body)}


@dataclass(frozen=True)
class Seen:
    """Everything the indexes hold about one CR."""

    observed: dict[str, RoleObservation | None]
    problems: list[PodProblem]
    pods: list[PodInfo]
    scaler: ScalerObservation | None
    links: tuple[OwnerLink, ...] = ()  # the model's Deployments and ReplicaSets (router_trust.py)

    @classmethod
    def of(cls, key: tuple, kw: Mapping[str, Any], seen: PodProblem | None = None) -> "Seen":
        """`seen`: a failure in the event being handled, which the index may already have dropped when the pod
        was deleted."""
        observed = dict(kw["worker_sets"].get(key, ())) | dict(kw["group_sets"].get(key, ()))
        observed |= dict(kw["router_sets"].get(key, ()))
        problems = list(kw["failing_pods"].get(key, ())) + ([seen] if seen else [])
        links = (*kw["deployment_links"].get(key, ()), *kw["replica_set_links"].get(key, ()))
        pods, scaler = list(kw["pod_infos"].get(key, ())), next(iter(kw["scalers"].get(key, ())), None)
        return cls(observed, problems, pods, scaler, links)

    @property
    def prefill_replicas(self) -> int | None:
        """Prefill's pods as its StatefulSet counts them; None until its controller has reported on it."""
        obs = self.observed.get(names.PREFILL)
        return obs.replicas if obs is not None and obs.current else None


@dataclass(frozen=True)
class Work:
    """What an event calls for, beyond refreshing the status."""

    apply_all: bool = False  # apply every child (the CR changed, or a child was deleted by hand)
    step: bool = False  # a StatefulSet or a pod changed: the rollout may move
    scaler: bool = False  # the prefill StatefulSet or the RoleScaler changed
    scaler_gone: bool = False  # the RoleScaler was deleted


def converge(runtime: Runtime, cr: Mapping[str, Any], read: Callable[[], Seen], work: Work) -> None:
    """Do `work` and refresh the status. The children that need no observation are applied first; the rest runs
    under the CR's lock, reading the indexes (`read`) inside it: a handler that waited for the lock acts on what
    the indexes hold now, not on what they held when its event arrived."""
    failed: ReconcileError | None = None
    if work.apply_all:
        try:
            runtime.apply_children(cr, workers=False)
        except ReconcileError as e:
            failed = e
    with runtime.locked(cr["metadata"]["uid"]):
        try:
            if failed is not None:
                raise failed
            seen = read()
            if work.apply_all:
                runtime.apply_children(cr, seen.observed, seen.pods, others=False)
            elif work.step:
                runtime.step_rollout(cr, seen.observed, seen.pods)
            if work.apply_all or work.scaler:
                runtime.sync_scaler(cr, seen.scaler, seen.prefill_replicas, recreate=work.scaler_gone)
        finally:  # the status says what happened, a failure included
            seen = read()
            runtime.refresh_status(cr, seen.observed, seen.problems, seen.pods, seen.links)


@kopf.on.resume(*CR)
@kopf.on.create(*CR)
@kopf.on.update(*CR)
def reconcile(namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **kw: Any) -> None:
    _remember_context(memo.runtime)
    try:
        converge(memo.runtime, _plain(body), lambda: Seen.of((namespace, name), kw), Work(apply_all=True))
    except ReconcileError as e:
        if e.permanent:
            raise kopf.PermanentError(str(e)) from e
        raise kopf.TemporaryError(str(e), delay=30) from e
    # Everything else is applied and reported; the gateway's objects are tried again until they go through.
    m = memo.runtime.known(body["metadata"]["uid"])
    if m is not None and m.gateway_errors:
        raise kopf.TemporaryError(m.gateway_errors[0], delay=GATEWAY_RETRY_S)


def _on_child(
    type: str | None,
    namespace: str | None,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    kw: Mapping[str, Any],
    work: Work,
    seen: PodProblem | None = None,
) -> None:
    runtime: Runtime = memo.runtime
    _remember_context(runtime)
    cr = next(iter(kw["models"].get(_key(namespace, labels), ())), None)
    if cr is None:
        return
    meta = cr["metadata"]
    if work.apply_all and not (
        type == "DELETED"
        and namespace not in runtime.terminating
        and runtime.cr_is_live(str(namespace), meta["name"], meta["uid"])
    ):
        work = replace(work, apply_all=False)
    try:
        converge(runtime, cr, lambda: Seen.of(_key(namespace, labels), kw, seen), work)
    except ReconcileError as e:  # event handlers are not retried: Degraded says it, the next event retries
        logger.warning("reconciling %s/%s after a child changed: %s", namespace, meta["name"], e)


def on_child(
    type: str | None,
    namespace: str | None,
    labels: Mapping[str, str],
    resource: kopf.Resource,
    memo: kopf.Memo,
    **kw: Any,
) -> None:
    """A child changed: recreate it if it was deleted by hand; a StatefulSet may move the rollout (and prefill's
    the RoleScaler's status); refresh the parent's status."""
    sets = resource.plural in ("statefulsets", names.LWS_PLURAL)
    prefill = sets and labels.get(names.ROLE_LABEL) == names.PREFILL
    _on_child(type, namespace, labels, memo, kw, Work(apply_all=True, step=sets, scaler=prefill))


def on_pod(
    type: str | None, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: kopf.Memo, **kw: Any
) -> None:
    """A pod changed: step a rollout, refresh the parent's status (pods are the StatefulSets' business)."""
    _on_child(type, namespace, labels, memo, kw, Work(step=True), seen=pod_problem(body))


def on_scaler(type: str | None, namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kw: Any) -> None:
    """A RoleScaler changed (scaled, or deleted by hand): hand its replicas on, or recreate it."""
    _on_child(type, namespace, labels, memo, kw, Work(scaler=True, scaler_gone=type == "DELETED"))


def _register_child_handlers() -> None:
    for group, version, plural in CHILD_KINDS:
        kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}")(on_child)
    kopf.on.event("", "v1", "pods", labels=MANAGED, id="child-pods")(on_pod)
    kopf.on.event(*SCALERS, labels=MANAGED, id="child-rolescalers")(on_scaler)


@kopf.on.event(*CR)
def forget_deleted(type: str | None, uid: str, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":
        memo.runtime.forget(uid)


_register_child_handlers()
