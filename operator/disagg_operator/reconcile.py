"""What one reconcile does: apply the children, then write the status if (and only if) it changed.

Reconciling is level-triggered: the desired children are rebuilt from the CR every time and server-side applied.
Status is recomputed from what the operator's watch indexes hold (StatefulSets, the router Deployment, failing
pods), so refreshing it reads nothing from the API server and writes only on a change.
"""

import datetime
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import builders, names
from .apply import Kube
from .config import OperatorConfig
from .spec import ModelSpec
from .status import (
    Event,
    PodProblem,
    RoleObservation,
    compute_status,
    latch_problems,
    settled_roles,
    status_changed,
    transitions,
)

log = logging.getLogger(__name__)

EventSink = Callable[[Mapping[str, Any], Event], None]


class ReconcileError(Exception):
    """A failure a user must fix (`permanent`) or one worth retrying."""

    def __init__(self, message: str, permanent: bool):
        super().__init__(message)
        self.permanent = permanent


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_api_error(obj: Mapping[str, Any], e: ApiException) -> ReconcileError:
    what = f"{obj['kind']} {obj['metadata']['name']}"
    permanent = e.status in (400, 403, 422)
    return ReconcileError(f"applying {what} failed ({e.status} {e.reason})", permanent)


@dataclass
class Runtime:
    """Process-wide operator state shared by all handlers: the client, the last status written per CR
    (by uid, so a recreated CR starts fresh) and the errors of the latest reconcile per CR."""

    kube: Kube
    cfg: OperatorConfig
    post_event: EventSink
    written: dict[str, dict] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)
    latched: dict[str, dict[str, PodProblem]] = field(default_factory=dict)
    terminating: set[str] = field(default_factory=set)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def _lock(self, uid: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget(self, uid: str) -> None:
        with self._guard:
            self._locks.pop(uid, None)
        self.written.pop(uid, None)
        self.errors.pop(uid, None)
        self.latched.pop(uid, None)

    def ensure_auth_secret(self, spec: ModelSpec) -> None:
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
        self.kube.create_if_absent(builders.build_auth_secret(spec, builders.new_token()))

    def apply_children(self, cr: Mapping[str, Any]) -> None:
        """Create or update every child of `cr`; records (and raises) the first failure."""
        spec = ModelSpec.from_cr(cr)
        try:
            self.ensure_auth_secret(spec)
            for obj in builders.build_children(spec, self.cfg):
                try:
                    self.kube.apply(obj)
                except ApiException as e:
                    if e.status == 403 and b"being terminated" in (e.body or b""):
                        self.terminating.add(spec.namespace)
                    raise describe_api_error(obj, e) from e
        except ReconcileError as e:
            self.errors[spec.uid] = [str(e)]
            raise
        self.errors.pop(spec.uid, None)
        self.terminating.discard(spec.namespace)

    def refresh_status(
        self, cr: Mapping[str, Any], observed: Mapping[str, RoleObservation | None], problems: Iterable[PodProblem]
    ) -> bool:
        """Write the CR's status when it differs from the last one written; post an Event per transition."""
        spec = ModelSpec.from_cr(cr)
        with self._lock(spec.uid):
            latched = latch_problems(self.latched.get(spec.uid, {}), problems, settled_roles(spec, observed))
            self.latched[spec.uid] = latched
            previous = self.written.get(spec.uid) or cr.get("status") or {}
            new = compute_status(
                spec,
                cr["metadata"].get("generation", 0),
                observed,
                sorted(latched.values(), key=lambda p: p.pod),
                self.errors.get(spec.uid, []),
                previous,
                builders.router_endpoint(spec),
                now(),
            )
            if not status_changed(previous, new):
                return False
            try:
                self.kube.patch_status(spec.namespace, spec.name, new)
            except ApiException as e:
                if e.status == 404:  # deleted meanwhile: nothing left to report on
                    return False
                raise
            self.written[spec.uid] = new
        for event in transitions(previous.get("conditions") or [], new["conditions"]):
            self.post_event(cr, event)
        return True

    def cr_is_live(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the CR still exists and is not being deleted (read fresh, not from a cache)."""
        current = self.kube.get(names.API_VERSION, names.KIND, namespace, name)
        return bool(
            current and current["metadata"].get("uid") == uid and not current["metadata"].get("deletionTimestamp")
        )
