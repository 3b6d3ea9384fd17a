"""Status and conditions as a pure function of what the children report."""

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from disagg_operator.builders import template_hash, worker_pod_template
from disagg_operator.config import OperatorConfig
from disagg_operator.reconcile import Runtime
from disagg_operator.routerview import merge_reports
from disagg_operator.scaling import ScalerObservation
from disagg_operator.spec import ModelSpec
from disagg_operator.status import (
    Findings,
    PodProblem,
    RoleObservation,
    compute_status,
    observe_workload,
    pod_problem,
    status_changed,
    transitions,
)

CR: dict[str, Any] = {
    "apiVersion": "disagg.dev/v1alpha1",
    "kind": "DisaggregatedModel",
    "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 3},
    "spec": {
        "model": {"hostPath": "/m", "path": "x"},
        "servedModelName": "m",
        "image": "img",
        "prefill": {"replicas": 1},
        "decode": {"replicas": 2},
        "router": {"replicas": 1},
    },
}
SPEC = ModelSpec.from_cr(CR)
# The template hash the operator records on a StatefulSet it applied: with it, no rollout is pending.
APPLIED = {r: template_hash(worker_pod_template(SPEC, r, OperatorConfig())) for r in ("prefill", "decode")}
ALL_READY = {
    "prefill": RoleObservation(1, 1, 1, template_hash=APPLIED["prefill"]),
    "decode": RoleObservation(2, 2, 2, template_hash=APPLIED["decode"]),
    "router": RoleObservation(1, 1, 1),
}


def conds(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def status(observed, problems=(), errors=(), previous=None, now="T1", findings=None) -> dict:
    found = findings or Findings()
    return compute_status(SPEC, 3, observed, list(problems), list(errors), previous or {}, "http://e", now, found)


def test_all_roles_ready_means_ready_and_not_progressing():
    s = status(ALL_READY)
    c = conds(s)
    assert (c["Ready"]["status"], c["Progressing"]["status"], c["Degraded"]["status"]) == ("True", "False", "False")
    assert c["Ready"]["message"] == "ready: prefill 1/1, decode 2/2, router 1/1"
    assert s["decode"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "ready": "2/2",
        "selector": "disagg.dev/model=m,disagg.dev/role=decode",
    }
    assert s["observedGeneration"] == 3 and all(x["observedGeneration"] == 3 for x in s["conditions"])


def test_missing_children_are_progressing_and_not_ready():
    c = conds(status({}))
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "ReplicasNotReady"
    assert c["Progressing"]["status"] == "True"
    assert "prefill, decode, router" in c["Progressing"]["message"]


def test_a_stale_controller_view_is_not_ready_even_with_matching_counts():
    observed = dict(ALL_READY, decode=RoleObservation(2, 2, 2, current=False))
    assert conds(status(observed))["Ready"]["status"] == "False"


def test_scaled_to_zero_says_why_it_cannot_serve():
    spec = ModelSpec.from_cr({**CR, "spec": {**CR["spec"], "decode": {"replicas": 0}}})
    s = compute_status(spec, 1, {**ALL_READY, "decode": RoleObservation(0, 0, 0)}, [], [], {}, "", "T")
    c = conds(s)
    assert c["Ready"]["reason"] == "ScaledToZero" and "decode has 0 replicas" in c["Ready"]["message"]


def test_failing_pod_is_degraded_with_its_name_and_reason():
    problem = PodProblem("m-decode-1", "decode", "container decode: Error (exit code 1)")
    c = conds(status(dict(ALL_READY, decode=RoleObservation(2, 1, 2)), problems=[problem]))
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "PodFailing"
    assert c["Degraded"]["message"] == "decode pod m-decode-1: container decode: Error (exit code 1)"


def test_reconcile_errors_block_and_degrade():
    c = conds(status(ALL_READY, errors=["auth Secret x not found"]))
    assert c["Degraded"]["reason"] == "ReconcileFailed" and "auth Secret x" in c["Degraded"]["message"]
    assert c["Ready"]["status"] == "False" and c["Progressing"]["reason"] == "Blocked"


def test_transition_time_moves_only_with_the_status():
    first = status({}, now="T1")
    same = status({}, previous=first, now="T2")
    assert not status_changed(first, same)
    ready = status(ALL_READY, previous=first, now="T3")
    assert conds(ready)["Ready"]["lastTransitionTime"] == "T3"
    assert conds(ready)["Degraded"]["lastTransitionTime"] == "T1"


def test_one_event_per_transition_with_warnings_for_bad_news():
    first = status({})
    assert [(e.type, e.reason) for e in transitions([], first["conditions"])] == [
        ("Normal", "ReplicasNotReady"),
        ("Normal", "RollingOut"),
        ("Normal", "AsExpected"),
    ]
    ready = status(ALL_READY, previous=first)
    assert [(e.type, e.reason) for e in transitions(first["conditions"], ready["conditions"])] == [
        ("Normal", "AllReplicasReady"),
        ("Normal", "Complete"),
    ]
    broken = status(
        dict(ALL_READY, decode=RoleObservation(2, 1, 2)),
        previous=ready,
        problems=[PodProblem("m-decode-0", "decode", "x")],
    )
    events = transitions(ready["conditions"], broken["conditions"])
    assert [(e.type, e.reason) for e in events] == [
        ("Warning", "ReplicasNotReady"),
        ("Normal", "RollingOut"),
        ("Warning", "PodFailing"),
    ]
    assert "m-decode-0" in events[2].message
    assert transitions(broken["conditions"], broken["conditions"]) == []


def test_observe_workload_reads_counts_and_generation():
    sts = {
        "metadata": {"generation": 4},
        "spec": {"replicas": 4},
        "status": {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3, "observedGeneration": 3},
    }
    assert observe_workload(sts) == RoleObservation(3, 2, 3, current=False, desired=4)
    assert observe_workload({"metadata": {"generation": 1}}) == RoleObservation(0, 0, 0, current=False, desired=1)


@pytest.mark.parametrize(
    "pod_status,expected",
    [
        (
            {"phase": "Running", "containerStatuses": [{"name": "decode", "ready": True, "state": {"running": {}}}]},
            None,
        ),
        (
            {
                "phase": "Pending",
                "containerStatuses": [{"name": "decode", "state": {"waiting": {"reason": "ContainerCreating"}}}],
            },
            None,
        ),
        (
            {
                "phase": "Running",
                "containerStatuses": [{"name": "decode", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}],
            },
            "container decode: CrashLoopBackOff",
        ),
        (
            {
                "phase": "Running",
                "containerStatuses": [
                    {"name": "decode", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
                ],
            },
            "container decode: OOMKilled (exit code 137)",
        ),
        ({"phase": "Failed", "reason": "Evicted"}, "Evicted"),
        (
            {
                "phase": "Pending",
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": 'persistentvolumeclaim "models" not found',
                    }
                ],
            },
            'unschedulable: persistentvolumeclaim "models" not found',
        ),
    ],
)
def test_pod_problem_names_what_a_user_would_look_for(pod_status, expected):
    pod = {"metadata": {"name": "m-decode-0", "labels": {"disagg.dev/role": "decode"}}, "status": pod_status}
    problem = pod_problem(pod)
    assert (problem.reason if problem else None) == expected


class FakeKube:
    """Records the operator's API calls against an in-memory store."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.status_writes: list[dict] = []
        self.applied: list[str] = []
        self.created: list[str] = []
        self.patches: list[tuple] = []

    def get(self, api_version, kind, namespace, name):
        return self.objects.get((kind, name))

    def apply(self, obj):
        self.applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        self.last_applied = obj

    def create_if_absent(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        if key in self.objects:
            return False
        self.objects[key] = obj
        self.created.append(f"{obj['kind']}/{obj['metadata']['name']}")
        return True

    def patch_status(self, namespace, name, status, kind="DisaggregatedModel"):
        if kind == "DisaggregatedModel":
            self.status_writes.append(status)
        else:
            self.patches.append((kind, name, "status", status))

    def patch(self, kind, namespace, name, body):
        self.patches.append((kind, name, "spec", body))


@dataclass
class RecordingRuntime(Runtime):
    """A Runtime over a FakeKube that keeps the Events it posts."""

    kube: Any
    events: list = field(default_factory=list)


@pytest.fixture
def runtime():
    from disagg_operator.config import OperatorConfig

    rt = RecordingRuntime(FakeKube(), OperatorConfig(), lambda cr, e: rt.events.append(e))
    return rt


def test_status_is_written_only_when_it_changes(runtime):
    assert runtime.refresh_status(CR, {}, [])
    assert not runtime.refresh_status(CR, {}, [])
    assert runtime.refresh_status(CR, ALL_READY, [])
    assert not runtime.refresh_status(CR, ALL_READY, [])
    assert len(runtime.kube.status_writes) == 2
    assert [e.reason for e in runtime.events] == [
        "ReplicasNotReady",
        "RollingOut",
        "AsExpected",
        "AllReplicasReady",
        "Complete",
    ]


def test_a_cached_status_on_the_cr_counts_as_written(runtime):
    written = compute_status(SPEC, 3, ALL_READY, [], [], {}, "http://m-router.ns.svc:8000", "T0")
    cr = {**CR, "status": written}
    assert not runtime.refresh_status(cr, ALL_READY, [])
    assert runtime.kube.status_writes == [] and runtime.events == []


def test_auth_secret_is_generated_once_and_children_applied(runtime):
    runtime.apply_children(CR)
    token = runtime.kube.objects[("Secret", "m-auth")]["data"]["token"]
    runtime.apply_children(CR)
    assert runtime.kube.created == ["Secret/m-auth"]
    assert runtime.kube.objects[("Secret", "m-auth")]["data"]["token"] == token
    assert "StatefulSet/m-decode" in runtime.kube.applied and len(runtime.kube.applied) == 26  # 13 children, twice


def test_an_object_the_model_did_not_create_is_left_alone_and_reported(runtime):
    """A Service someone else made under the router's name, and an auth Secret of the default name that is not
    the model's: neither is written (nor owned, nor garbage-collected with the model); Degraded names both."""
    from disagg_operator.apply_errors import ReconcileError

    theirs = {"metadata": {"name": "m-router", "ownerReferences": [{"kind": "Deployment", "name": "x", "uid": "u"}]}}
    runtime.kube.objects[("Service", "m-router")] = {"kind": "Service", **theirs}
    runtime.kube.objects[("Secret", "m-auth")] = {"kind": "Secret", "metadata": {"name": "m-auth"}}
    with pytest.raises(ReconcileError) as err:
        runtime.apply_children(CR)
    assert "Secret m-auth already exists and was not created by this model" in str(err.value)
    runtime.kube.objects.pop(("Secret", "m-auth"))
    with pytest.raises(ReconcileError) as err:
        runtime.apply_children(CR)
    assert "Service m-router" not in runtime.kube.applied and "Service/m-router" not in runtime.kube.applied
    assert "StatefulSet/m-decode" in runtime.kube.applied  # the other children are applied
    runtime.refresh_status(CR, ALL_READY, [])
    degraded = conds(runtime.kube.status_writes[-1])["Degraded"]
    assert degraded["status"] == "True" and "Service m-router already exists" in degraded["message"]


def test_a_child_of_an_earlier_model_of_the_same_name_waits_for_the_garbage_collector(runtime):
    """Only an owner reference to this CR's uid makes an object the model's: a forged or stale one does not."""
    from disagg_operator.apply_errors import ReconcileError

    before = {"kind": "DisaggregatedModel", "name": CR["metadata"]["name"], "uid": "an-earlier-uid"}
    runtime.kube.objects[("Service", "m-router")] = {"kind": "Service", "metadata": {"ownerReferences": [before]}}
    with pytest.raises(ReconcileError, match="Service m-router already exists"):
        runtime.apply_children(CR)
    runtime.kube.objects.pop(("Service", "m-router"))  # collected
    runtime.apply_children(CR)
    assert "Service/m-router" in runtime.kube.applied


def test_missing_named_secret_degrades_with_a_message(runtime):
    from disagg_operator.apply_errors import ReconcileError

    cr = {**CR, "spec": {**CR["spec"], "auth": {"secretName": "absent"}}}
    with pytest.raises(ReconcileError) as err:
        runtime.apply_children(cr)
    assert not err.value.permanent
    runtime.refresh_status(cr, ALL_READY, [])
    degraded = conds(runtime.kube.status_writes[-1])["Degraded"]
    assert degraded["status"] == "True" and "auth Secret absent not found" in degraded["message"]


def test_a_replaced_pods_failure_stays_reported_until_its_role_is_whole_again(runtime):
    failed = PodProblem("m-decode-0", "decode", "container decode: Error (exit code 1)")
    replacing = dict(ALL_READY, decode=RoleObservation(2, 1, 2, template_hash=APPLIED["decode"]))
    runtime.refresh_status(CR, replacing, [failed])
    runtime.refresh_status(CR, replacing, [])  # the failed pod is gone, its replacement is not ready yet
    assert conds(runtime.kube.status_writes[-1])["Degraded"]["status"] == "True"
    runtime.refresh_status(CR, ALL_READY, [])
    assert conds(runtime.kube.status_writes[-1])["Degraded"]["status"] == "False"
    assert [e.reason for e in runtime.events][-3:] == ["AllReplicasReady", "Complete", "AsExpected"]


def test_a_failed_pod_being_deleted_still_counts_but_a_normal_shutdown_does_not():
    pod: dict[str, Any] = {
        "metadata": {"name": "m-decode-0", "labels": {"disagg.dev/role": "decode"}, "deletionTimestamp": "T"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "decode", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}],
        },
    }
    problem = pod_problem(pod)
    assert problem is not None and problem.reason == "container decode: Error (exit code 1)"
    pod["status"]["phase"] = "Running"
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = 143
    assert pod_problem(pod) is None


def test_a_terminating_namespace_is_remembered_until_a_reconcile_succeeds(runtime):
    from kubernetes.client.exceptions import ApiException

    from disagg_operator.apply_errors import ReconcileError

    def refuse(obj):
        raise ApiException(status=403, reason="Forbidden")

    runtime.kube.apply = refuse
    with pytest.raises(ReconcileError):
        runtime.apply_children(CR)
    assert runtime.terminating == set()

    def terminating(obj):
        e = ApiException(status=403, reason="Forbidden")
        # The API client hands reconcile the raw response body (bytes), whatever its annotation says.
        e.body = b"unable to create new content in namespace ns because it is being terminated"  # type: ignore[assignment]
        raise e

    runtime.kube.apply = terminating
    with pytest.raises(ReconcileError) as err:
        runtime.apply_children(CR)
    assert runtime.terminating == {"ns"} and err.value.permanent
    runtime.kube.apply = lambda obj: None
    runtime.apply_children(CR)
    assert runtime.terminating == set()


def test_ready_needs_a_verified_pair_and_failing_pairs_are_named():
    view = merge_reports(
        {"m-router-0": {"pairs": [{"prefill": "p0", "decode": "d0", "verified": False, "error": "x"}]}}
    )
    c = conds(status(ALL_READY, findings=Findings(router=view)))
    assert c["PairingVerified"]["status"] == "False" and "p0 -> d0: x" in c["PairingVerified"]["message"]
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "PairingNotVerified"
    assert c["HandoffStalled"]["status"] == "False"
    fine = conds(status(ALL_READY))
    assert fine["Ready"]["status"] == "True" and fine["PairingVerified"]["reason"] == "RouterReady"
    assert fine["HandoffStalled"]["status"] == "Unknown"


def test_pairing_and_stalls_speak_through_events_only_when_they_go_bad_or_recover():
    first = status({})
    ready = status(ALL_READY, previous=first)
    assert "PairingVerified" not in [
        e.message.split("=")[0] for e in transitions(first["conditions"], ready["conditions"])
    ]
    bad = merge_reports(
        {
            "m-router-0": {
                "pairs": [{"prefill": "p0", "decode": "d0", "verified": False, "error": "x"}],
                "handoff": {
                    "stall_after_s": 60,
                    "workers": [{"pod": "d0", "role": "decode", "stalled_queues": ["decode_transfer"]}],
                },
            }
        }
    )
    broken = status(ALL_READY, previous=ready, findings=Findings(router=bad))
    events = {e.reason: e.type for e in transitions(ready["conditions"], broken["conditions"])}
    assert events == {"PairingNotVerified": "Warning", "NoVerifiedPair": "Warning", "QueueStalled": "Warning"}
    good = merge_reports(
        {"m-router-0": {"pairs": [{"prefill": "p0", "decode": "d0", "verified": True}], "handoff": {}}}
    )
    healed = status(ALL_READY, previous=broken, findings=Findings(router=good))
    events = {e.reason: e.type for e in transitions(broken["conditions"], healed["conditions"])}
    assert events == {"AllReplicasReady": "Normal", "PairsVerified": "Normal", "Flowing": "Normal"}


def test_a_template_change_steps_decode_first_and_applies_only_what_moved(runtime):
    in_place = {**CR["spec"], "rollout": {"maxSurge": 0}}
    changed = {**CR, "spec": {**in_place, "image": "img:2"}}
    applied = []
    runtime.kube.apply = applied.append
    runtime.step_rollout(changed, ALL_READY, [])
    partitions = {o["metadata"]["name"]: o["spec"]["updateStrategy"]["rollingUpdate"]["partition"] for o in applied}
    assert partitions == {"m-prefill": 1, "m-decode": 1}  # prefill held whole, decode's last pod released
    assert {o["metadata"]["name"]: o["spec"]["replicas"] for o in applied} == {"m-prefill": 1, "m-decode": 2}
    assert {o["spec"]["template"]["spec"]["containers"][0]["image"] for o in applied} == {"img:2"}
    applied.clear()
    runtime.step_rollout({**CR, "spec": in_place}, ALL_READY, [])
    assert applied == []
    runtime.refresh_status(changed, ALL_READY, [])
    written = runtime.kube.status_writes[-1]
    assert written["rollout"]["decode"] == {"released": 1, "updatedReady": 0}
    assert conds(written)["Progressing"]["reason"] == "RollingOut"


def test_a_template_change_first_starts_one_new_pod_per_role_beside_the_old_ones(runtime):
    changed = {**CR, "spec": {**CR["spec"], "image": "img:2"}}
    applied = []
    runtime.kube.apply = applied.append
    runtime.step_rollout(changed, ALL_READY, [])
    # One more pod per role, on the new template (the partition keeps every old ordinal on the old one).
    assert {o["metadata"]["name"]: o["spec"]["replicas"] for o in applied} == {"m-prefill": 2, "m-decode": 3}
    partitions = {o["metadata"]["name"]: o["spec"]["updateStrategy"]["rollingUpdate"]["partition"] for o in applied}
    assert partitions == {"m-prefill": 1, "m-decode": 2}
    runtime.refresh_status(changed, ALL_READY, [])
    written = runtime.kube.status_writes[-1]
    assert written["rollout"]["prefill"] == written["rollout"]["decode"] == {"released": 1, "updatedReady": 0}
    assert "inPlace" not in written["rollout"]
    assert conds(written)["Progressing"]["reason"] == "RollingOut"


def test_the_role_scaler_is_created_once_then_kept_in_step(runtime):
    runtime.sync_scaler(CR, None, 1)
    assert runtime.kube.created == ["RoleScaler/m-prefill"]
    scaled = ScalerObservation(3, 2, {"replicas": 1, "selector": "s", "observedGeneration": 1})
    runtime.sync_scaler(CR, scaled, 1)
    assert runtime.kube.patches == [
        ("DisaggregatedModel", "m", "spec", {"spec": {"prefill": {"replicas": 3}}}),
        (
            "RoleScaler",
            "m-prefill",
            "status",
            {"replicas": 1, "selector": "disagg.dev/model=m,disagg.dev/role=prefill", "observedGeneration": 2},
        ),
    ]
    deleting = {**CR, "metadata": {**CR["metadata"], "deletionTimestamp": "T"}}
    runtime.kube.objects.clear()
    runtime.sync_scaler(deleting, None, 1)
    assert runtime.kube.created == ["RoleScaler/m-prefill"]


def test_a_deleted_cr_is_neither_written_nor_ticked_again(runtime):
    from kubernetes.client.exceptions import ApiException

    def gone(namespace, name, status, kind="DisaggregatedModel"):
        raise ApiException(status=404, reason="Not Found")

    runtime.kube.patch_status = gone
    assert not runtime.refresh_status(CR, ALL_READY, [])
    assert runtime.latest_inputs() == {} and runtime.router_pods() == {}
    calls = []
    runtime.kube.patch_status = lambda *a, **k: calls.append(a)
    runtime.tick("u1")  # the clock finds nothing to do for it
    assert not runtime.refresh_status(CR, ALL_READY, [])  # a handler that began before the deletion
    other = {**CR, "metadata": {**CR["metadata"], "uid": "u2"}}
    runtime.refresh_status(other, ALL_READY, [])
    runtime.forget("u2")
    assert not runtime.refresh_status(other, ALL_READY, []) and len(calls) == 1


def test_role_scaler_writes_are_made_once_while_the_index_lags(runtime):
    runtime.sync_scaler(CR, None, 1)
    runtime.sync_scaler(CR, None, 1)  # the index has not seen the new RoleScaler yet
    assert runtime.kube.created == ["RoleScaler/m-prefill"]
    scaled = ScalerObservation(3, 2, {"replicas": 1, "selector": "s", "observedGeneration": 1})
    for _ in range(3):  # our writes are not in the index yet: each event sees the same scaler
        runtime.sync_scaler(CR, scaled, 1)
    assert [p[2] for p in runtime.kube.patches] == ["spec", "status"]
    again = ScalerObservation(5, 3, {"replicas": 1, "selector": "s", "observedGeneration": 2})
    runtime.sync_scaler(CR, again, 1)  # scaled once more: a new generation is handed on
    assert runtime.kube.patches[-2][3] == {"spec": {"prefill": {"replicas": 5}}}
    runtime.kube.objects.clear()
    runtime.sync_scaler(CR, None, 1, recreate=True)  # deleted by hand
    assert runtime.kube.created == ["RoleScaler/m-prefill", "RoleScaler/m-prefill"]


def test_a_reconcile_that_fails_before_the_workers_still_reports_it(runtime):
    from disagg_operator.apply_errors import ReconcileError
    from disagg_operator.handlers import Seen, Work, converge

    cr = {**CR, "spec": {**CR["spec"], "auth": {"secretName": "absent"}}}
    applied = []
    runtime.kube.apply = applied.append
    with pytest.raises(ReconcileError):
        converge(runtime, cr, lambda: Seen(dict(ALL_READY), [], [], None), Work(apply_all=True))
    assert applied == []  # nothing applied without the Secret
    degraded = conds(runtime.kube.status_writes[-1])["Degraded"]
    assert degraded["reason"] == "ReconcileFailed" and "auth Secret absent not found" in degraded["message"]


def test_without_leaderworkerset_in_the_cluster_a_multi_node_role_is_reported_not_retried_forever(runtime):
    from kubernetes.client.exceptions import ApiException

    from disagg_operator.apply_errors import LWS_MISSING, ReconcileError

    applied: list[str] = []

    def apply(obj):
        if obj["kind"] == "LeaderWorkerSet":  # the API server has no such resource: 404 on the collection
            raise ApiException(status=404, reason="Not Found")
        applied.append(obj["kind"])

    runtime.kube.apply = apply
    spanning = copy.deepcopy(CR)
    spanning["spec"]["decode"].update(tpSize=2, gpusPerNode=1)
    with pytest.raises(ReconcileError) as err:
        runtime.apply_children(spanning)
    assert str(err.value) == LWS_MISSING and not err.value.permanent  # retried once LWS is installed
    assert "StatefulSet" in applied  # prefill, a one-node role, went ahead
    runtime.refresh_status(spanning, {}, [])
    c = conds(runtime.models["u1"].written)
    assert c["Ready"]["status"] == "False" and "LeaderWorkerSet is not installed" in c["Ready"]["message"]
    assert c["Degraded"]["status"] == "True" and "LeaderWorkerSet is not installed" in c["Degraded"]["message"]
