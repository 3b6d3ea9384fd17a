"""What the operator remembers about one model (one DisaggregatedModel, by uid) between its events.

The Runtime (reconcile.py) keeps one ModelState per uid in one dict, and a deleted model's state goes with one pop:
whatever is added here is forgotten with the rest. It lives in the operator's memory only (a restarted operator
starts without it): each piece saves a read or a write, or keeps a decision steady while the watch indexes lag
behind the operator's own writes.
"""

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .observe import OwnerLink, PodInfo, PodProblem, RoleObservation
from .routerview import RouterView

Observed = Mapping[str, RoleObservation | None]
Child = tuple[str, str]  # (kind, name) of one of the model's children


@dataclass(frozen=True)
class Inputs:
    """The latest observation a CR's status was computed from, kept so a timer can recompute it."""

    cr: Mapping[str, Any]
    observed: Observed
    problems: tuple[PodProblem, ...]
    pods: tuple[PodInfo, ...]
    links: tuple[OwnerLink, ...] = ()  # the model's ReplicaSets and Deployments (router_trust.py)


@dataclass
class ModelState:
    """One model's state: the lock its handlers share, the last status written, the latest reconcile's errors,
    the latest inputs and router view, and what the rollout, the RoleScaler and the children's ownership were
    last seen or made to be."""

    # Serialises everything the operator does for the model (Runtime.locked).
    lock: threading.RLock = field(default_factory=threading.RLock)
    written: dict | None = None  # the status last written (None: none yet; the CR's own status stands in)
    errors: list[str] = field(default_factory=list)  # the latest reconcile's failures (empty: it succeeded)
    gateway_errors: list[str] = field(default_factory=list)  # the gateway's children's, apart (gateway_step.py)
    latched: dict[str, PodProblem] = field(default_factory=dict)  # pod -> failure, reported until its role is whole
    inputs: Inputs | None = None  # what the status was last computed from; None until then, or once deleted
    view: RouterView | None = None  # the routers' latest reports (prober.py); None: readiness alone speaks
    refused: tuple[str, ...] = ()  # the router-labelled pods last named as not the Deployment's (router_trust.py)
    # role -> (template hash, partition) last applied: within one template a partition only goes down, even when
    # a handler plans from an index that has not yet seen the latest apply.
    partitions: dict[str, tuple[str, int]] = field(default_factory=dict)
    # pairing revision -> the surge pods a rollout gave up (it rolls in place); status.rollout keeps them too.
    in_place: dict[str, tuple[str, ...]] = field(default_factory=dict)
    scaler_sent: dict[str, Any] = field(default_factory=dict)  # the RoleScaler writes made, per scaler generation
    # The children seen to carry the model's owner reference (or created by it): the operator never server-side
    # applies over an object it did not create, and reads each one only until it knows.
    owned: set[Child] = field(default_factory=set)
    pruned: set[Child] = field(default_factory=set)  # retired children known to be absent (prune.py)
