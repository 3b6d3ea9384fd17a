"""What the router pods say about the prefill->decode path, merged, and the conditions it yields.

Each router continuously verifies the pairs it may use (a synthetic one-token request through bootstrap and a real
KV transfer) and watches the workers' handoff queues and failure counters; its `/health` lists both. The operator
reads `/health` of every router pod (prober.py) and turns the answers into PairingVerified, HandoffStalled and
`status.transfer`. When no router pod answers (the operator runs outside the cluster network, or probing is off),
PairingVerified falls back to the router pods' readiness, which the kubelet grants only while the router has a
verified pair, and HandoffStalled is Unknown.

Messages hold no ages or timestamps, so a status changes only when what it says changes.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .observe import RoleObservation
from .spec import ModelSpec

MAX_NAMED = 5
NO_DETAILS = "pair details unavailable: the operator cannot read the router pods' /health"


@dataclass(frozen=True)
class PairResult:
    prefill: str
    decode: str
    verified: bool
    error: str = ""
    revision: str = ""  # the pairing revision both pods report


@dataclass(frozen=True)
class WorkerHandoff:
    pod: str
    role: str
    bootstrap_failures: int = 0
    transfer_failures: int = 0
    stalled: str = ""  # which queues hold requests without progress, or ""


@dataclass(frozen=True)
class RouterView:
    """The merged reports of the router pods that answered (`reached` of `probed`)."""

    probed: int
    reached: int
    without_pair: tuple[str, ...] = ()  # router pods with no verified pair
    pairs: tuple[PairResult, ...] = ()
    workers: tuple[WorkerHandoff, ...] = ()
    window_s: int = 0
    # The LoRA adapters a healthy prefill and a healthy decode both serve, in the view of every router that lists
    # its workers; None when none does (a router shows its workers only to the operator's probe token).
    adapters: frozenset[str] | None = None


def _text(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _count(value: Any) -> int:
    """A non-negative int from a report, 0 for anything else (bool, float, str, a dict...)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _entries(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a report's list; not a list reads as empty, an entry that is not an object is skipped."""
    return [x for x in value if isinstance(x, Mapping)] if isinstance(value, list) else []


def _pair(p: Mapping[str, Any]) -> PairResult:
    return PairResult(
        _text(p.get("prefill"), "?"),
        _text(p.get("decode"), "?"),
        p.get("verified") is True,  # only a JSON true verifies; anything else reads as failed
        _text(p.get("error")),
        _text(p.get("revision")),
    )


def _worker(w: Mapping[str, Any], stall_after: int) -> WorkerHandoff:
    queues = w.get("stalled_queues")
    stalled = [q for q in queues if isinstance(q, str)] if isinstance(queues, list) else []
    return WorkerHandoff(
        _text(w.get("pod"), "?"),
        _text(w.get("role"), "?"),
        _count(w.get("bootstrap_failures")),
        _count(w.get("transfer_failures")),
        f"{', '.join(stalled)} hold requests without handoff progress for over {stall_after} s" if stalled else "",
    )


def _paired_adapters(workers: Any) -> frozenset[str] | None:
    """The adapters one router's healthy prefills and healthy decodes both list; None without a workers list."""
    if not isinstance(workers, list):
        return None
    held: dict[str, set[str]] = {"prefill": set(), "decode": set()}
    for w in _entries(workers):
        names = w.get("lora_adapters")
        if w.get("healthy") is True and w.get("role") in held and isinstance(names, list):
            held[w["role"]].update(a for a in names if isinstance(a, str))
    return frozenset(held["prefill"] & held["decode"])


def merge_reports(reports: Mapping[str, Mapping[str, Any] | None]) -> RouterView:
    """`reports`: router pod name -> its parsed /health (None when it did not answer). Pairs keep the worst
    result any router saw; worker counters keep the largest any router saw (they read the same workers).

    Parsing is total: a report is JSON from a pod, so a field of the wrong type reads as absent (a pair as failed),
    and one malformed report changes only what its own pod says."""
    answered = {pod: r for pod, r in reports.items() if isinstance(r, Mapping) and r}
    pairs: dict[tuple[str, str], PairResult] = {}
    workers: dict[str, WorkerHandoff] = {}
    without_pair = []
    window = 0
    adapters: frozenset[str] | None = None
    for pod, report in answered.items():
        mine_adapters = _paired_adapters(report.get("workers"))
        if mine_adapters is not None:
            adapters = mine_adapters if adapters is None else adapters & mine_adapters
        mine = [_pair(p) for p in _entries(report.get("pairs"))]
        if not any(p.verified for p in mine):
            without_pair.append(pod)
        for p in mine:
            old = pairs.get((p.prefill, p.decode))
            pairs[(p.prefill, p.decode)] = p if old is None or old.verified else old
        handoff = report.get("handoff")
        if not isinstance(handoff, Mapping):
            handoff = {}
        window = max(window, _count(handoff.get("window_s")))
        stall_after = _count(handoff.get("stall_after_s"))
        for w in (_worker(x, stall_after) for x in _entries(handoff.get("workers"))):
            old_w = workers.get(w.pod)
            if old_w is None or (w.bootstrap_failures + w.transfer_failures, w.stalled) > (
                old_w.bootstrap_failures + old_w.transfer_failures,
                old_w.stalled,
            ):
                workers[w.pod] = w
    return RouterView(
        probed=len(reports),
        reached=len(answered),
        without_pair=tuple(sorted(without_pair)),
        pairs=tuple(pairs[k] for k in sorted(pairs)),
        workers=tuple(workers[k] for k in sorted(workers)),
        window_s=window,
        adapters=adapters,
    )


def verified_pairs(view: RouterView | None, revision: str) -> frozenset[tuple[str, str]] | None:
    """The (prefill, decode) pods of `revision` verified by the routers that list them (a pair one router failed
    counts as failed); None when no router answered (the operator cannot tell, so a rollout goes by the pods'
    readiness alone)."""
    if view is None or not view.reached:
        return None
    return frozenset((p.prefill, p.decode) for p in view.pairs if p.verified and p.revision == revision)


def _named(items: list[str]) -> str:
    more = f" and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else ""
    return "; ".join(items[:MAX_NAMED]) + more


def pairing_condition(spec: ModelSpec, router: RoleObservation | None, view: RouterView | None) -> tuple[str, str, str]:
    """(status, reason, message) of PairingVerified."""
    desired = spec.router.replicas
    if desired == 0:
        return "False", "NoRouter", "router.replicas is 0: no router verifies pairs or serves requests"
    if view is None or not view.reached:
        obs = router or RoleObservation()
        if obs.current and obs.ready >= desired:
            return (
                "True",
                "RouterReady",
                f"every router pod is Ready, which a router becomes with its first verified pair ({NO_DETAILS})",
            )
        return (
            "Unknown",
            "RouterNotReady",
            f"router pods ready {obs.ready}/{desired}; a router is Ready once it has verified a pair ({NO_DETAILS})",
        )
    failing = [f"{p.prefill} -> {p.decode}: {p.error or 'failed'}" for p in view.pairs if not p.verified]
    if not view.pairs:
        return "Unknown", "WaitingForWorkers", "the router sees no healthy prefill and decode pod to pair yet"
    if view.without_pair:
        return (
            "False",
            "NoVerifiedPair",
            f"router {', '.join(view.without_pair)} has no verified pair; failing: {_named(failing)}",
        )
    ok = len(view.pairs) - len(failing)
    if failing:
        return (
            "True",
            "SomePairsFailing",
            f"{ok} of {len(view.pairs)} pairs verified; out of rotation: {_named(failing)}",
        )
    return "True", "PairsVerified", f"all {ok} prefill->decode pairs verified"


def missing_adapters(spec: ModelSpec, view: RouterView | None) -> tuple[str, ...]:
    """The adapters of `spec.lora` no healthy prefill and decode pair serves, as the routers see them; none when
    the routers show no workers (the pods' readiness then says it: a worker that cannot load an adapter does not
    start)."""
    if spec.lora is None or view is None or view.adapters is None:
        return ()
    return tuple(a for a in spec.lora.names if a not in view.adapters)


def handoff_condition(view: RouterView | None) -> tuple[str, str, str]:
    """(status, reason, message) of HandoffStalled."""
    if view is None or not view.reached:
        return (
            "Unknown",
            "NotObserved",
            "handoff queues are unobserved: the operator cannot read the router pods' /health",
        )
    stalled = [f"{w.role} pod {w.pod}: {w.stalled}" for w in view.workers if w.stalled]
    if stalled:
        return "True", "QueueStalled", _named(stalled)
    return "False", "Flowing", "no prefill or decode queue holds requests without progress"


def transfer_status(view: RouterView | None) -> dict | None:
    """`status.transfer`: failure counts per role over the routers' window (None clears it)."""
    if view is None or not view.reached:
        return None
    out: dict[str, Any] = {"windowSeconds": view.window_s}
    for role in ("prefill", "decode"):
        mine = [w for w in view.workers if w.role == role]
        out[role] = {
            "bootstrapFailures": sum(w.bootstrap_failures for w in mine),
            "transferFailures": sum(w.transfer_failures for w in mine),
        }
    out["failingPods"] = sorted(w.pod for w in view.workers if w.bootstrap_failures or w.transfer_failures)
    return out
