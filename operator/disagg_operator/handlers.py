"""kopf handlers: they read, call the builders, apply, and report. No decisions live here.

Watches: the DisaggregatedModels, and every object labelled `app.kubernetes.io/managed-by=disagg-operator`
(StatefulSets, Deployments, Services, PodDisruptionBudgets, NetworkPolicies, Pods). A child's event maps to its
parent through the `disagg.dev/model` label; an idle cluster produces no events and so no writes.
"""

import copy
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from . import names
from .apply import Kube, load_client
from .config import OperatorConfig
from .reconcile import ReconcileError, Runtime
from .status import Event, PodProblem, observe_workload, pod_problem

MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
logger = logging.getLogger(__name__)
WORKERS = 16
CR = (names.GROUP, names.VERSION, names.PLURAL)
CHILD_KINDS = [
    ("apps", "v1", "statefulsets"),
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
]


def post_event(cr: Mapping[str, Any], event: Event) -> None:
    kopf.event(dict(cr), type=event.type, reason=event.reason, message=event.message)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{names.GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = WORKERS
    memo.runtime = Runtime(Kube(load_client(pool_size=2 * WORKERS)), OperatorConfig.from_env(), post_event)


def _plain(body: kopf.Body) -> dict[str, Any]:
    return copy.deepcopy({k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")})


@kopf.index(*CR)
def models(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): _plain(body)}


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED)
def worker_sets(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels.get(names.MODEL_LABEL)): (labels.get(names.ROLE_LABEL), observe_workload(body))}


@kopf.index("apps", "v1", "deployments", labels=MANAGED)
def router_sets(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict:
    return {(namespace, labels.get(names.MODEL_LABEL)): (labels.get(names.ROLE_LABEL), observe_workload(body))}


@kopf.index("", "v1", "pods", labels=MANAGED)
def failing_pods(namespace: str, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict | None:
    problem = pod_problem(body)
    return {(namespace, labels.get(names.MODEL_LABEL)): problem} if problem else None


def _one(index: kopf.Index, key: tuple) -> Any:
    return next(iter(index.get(key, ())), None)


def refresh(
    runtime: Runtime,
    cr: Mapping[str, Any],
    worker_sets: kopf.Index,
    router_sets: kopf.Index,
    failing_pods: kopf.Index,
    seen: PodProblem | None = None,
) -> None:
    """Recompute the CR's status from the indexes (plus `seen`: a failure in the event being handled, which
    the index may already have dropped when the pod was deleted)."""
    key = (cr["metadata"]["namespace"], cr["metadata"]["name"])
    observed = dict(worker_sets.get(key, ())) | dict(router_sets.get(key, ()))
    problems = list(failing_pods.get(key, ())) + ([seen] if seen else [])
    runtime.refresh_status(cr, observed, problems)


@kopf.on.resume(*CR)
@kopf.on.create(*CR)
@kopf.on.update(*CR)
def reconcile(
    body: kopf.Body,
    memo: kopf.Memo,
    worker_sets: kopf.Index,
    router_sets: kopf.Index,
    failing_pods: kopf.Index,
    **_: Any,
) -> None:
    runtime: Runtime = memo.runtime
    cr = _plain(body)
    try:
        runtime.apply_children(cr)
    except ReconcileError as e:
        refresh(runtime, cr, worker_sets, router_sets, failing_pods)
        if e.permanent:
            raise kopf.PermanentError(str(e)) from e
        raise kopf.TemporaryError(str(e), delay=30) from e
    refresh(runtime, cr, worker_sets, router_sets, failing_pods)


def _on_child(
    type: str | None,
    namespace: str,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    models: kopf.Index,
    worker_sets: kopf.Index,
    router_sets: kopf.Index,
    failing_pods: kopf.Index,
    recreate: bool,
    seen: PodProblem | None = None,
) -> None:
    runtime: Runtime = memo.runtime
    cr = _one(models, (namespace, labels.get(names.MODEL_LABEL)))
    if cr is None:
        return
    meta = cr["metadata"]
    if (
        recreate
        and type == "DELETED"
        and namespace not in runtime.terminating
        and runtime.cr_is_live(namespace, meta["name"], meta["uid"])
    ):
        try:
            runtime.apply_children(cr)
        except ReconcileError as e:  # event handlers are not retried: Degraded says it, the next event retries
            logger.warning("recreating children of %s/%s: %s", namespace, meta["name"], e)
    refresh(runtime, cr, worker_sets, router_sets, failing_pods, seen)


def _register_child_handlers() -> None:
    for group, version, plural in CHILD_KINDS:
        kopf.on.event(group, version, plural, labels=MANAGED, id=f"child-{plural}")(on_child)
    kopf.on.event("", "v1", "pods", labels=MANAGED, id="child-pods")(on_pod)


def on_child(
    type: str | None,
    namespace: str,
    labels: Mapping[str, str],
    memo: kopf.Memo,
    models: kopf.Index,
    worker_sets: kopf.Index,
    router_sets: kopf.Index,
    failing_pods: kopf.Index,
    **_: Any,
) -> None:
    """A child changed: recreate it if it was deleted by hand, then refresh the parent's status."""
    _on_child(type, namespace, labels, memo, models, worker_sets, router_sets, failing_pods, recreate=True)


def on_pod(
    type: str | None,
    namespace: str,
    labels: Mapping[str, str],
    body: kopf.Body,
    memo: kopf.Memo,
    models: kopf.Index,
    worker_sets: kopf.Index,
    router_sets: kopf.Index,
    failing_pods: kopf.Index,
    **_: Any,
) -> None:
    """A pod changed: refresh the parent's status (pods are the StatefulSets' business to recreate)."""
    _on_child(
        type,
        namespace,
        labels,
        memo,
        models,
        worker_sets,
        router_sets,
        failing_pods,
        recreate=False,
        seen=pod_problem(body),
    )


@kopf.on.event(*CR)
def forget_deleted(type: str | None, uid: str, memo: kopf.Memo, **_: Any) -> None:
    if type == "DELETED":
        memo.runtime.forget(uid)


_register_child_handlers()
