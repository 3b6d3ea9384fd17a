"""The operator probes (and shows the model's health token to) only the router pods its Deployment created."""

from typing import Any

from disagg_operator.config import OperatorConfig
from disagg_operator.observe import OwnerLink, PodInfo, RoleObservation, observe_link, observe_pod
from disagg_operator.reconcile import Runtime
from disagg_operator.router_trust import router_targets

MODEL, DEPLOYMENT, RS = "uid-model", "uid-deploy", "uid-rs"
LINKS = (
    OwnerLink(DEPLOYMENT, "Deployment", "m-router", MODEL),
    OwnerLink(RS, "ReplicaSet", "m-router-5f7c", DEPLOYMENT),
)


def pod(name: str, kind: str = "ReplicaSet", uid: str = RS, role: str = "router", ip: str = "10.0.0.1") -> PodInfo:
    return PodInfo(name, role, ip=ip, owner_kind=kind, owner_uid=uid)


def test_only_pods_whose_owner_chain_leads_to_the_models_router_deployment_are_probed():
    pods = [
        pod("m-router-5f7c-a"),
        pod("m-router-5f7c-b", ip=""),  # not addressable yet: neither probed nor refused
        pod("forged-unowned", kind="", uid=""),
        pod("forged-by-a-job", kind="Job", uid=RS),  # the right uid under the wrong kind
        pod("forged-other-rs", uid="uid-other-rs"),
        pod("m-prefill-0", role="prefill", kind="StatefulSet", uid="uid-sts"),
    ]
    other_rs = OwnerLink("uid-other-rs", "ReplicaSet", "evil", "uid-evil-deploy")
    evil = OwnerLink("uid-evil-deploy", "Deployment", "m-router", "uid-someone-else")  # the name, not the owner
    targets = router_targets(MODEL, "m", pods, (*LINKS, other_rs, evil))
    assert targets.probe == {"m-router-5f7c-a": "10.0.0.1"}
    assert targets.refused == ("forged-by-a-job", "forged-other-rs", "forged-unowned")


def test_a_deployment_owned_by_the_model_under_another_name_is_not_its_router():
    kvstore = OwnerLink(DEPLOYMENT, "Deployment", "m-kvstore", MODEL)
    targets = router_targets(MODEL, "m", [pod("r")], (kvstore, LINKS[1]))
    assert targets.probe == {} and targets.refused == ("r",)


def test_a_pod_whose_replica_set_is_not_observed_yet_waits_unnamed():
    assert router_targets(MODEL, "m", [pod("r", uid="uid-new-rs")], LINKS) == router_targets(MODEL, "m", [], LINKS)


def test_the_links_come_from_the_objects_controlling_owner_references():
    ref = {"kind": "ReplicaSet", "uid": RS, "controller": True, "name": "m-router-5f7c"}
    info = observe_pod({"metadata": {"name": "p", "ownerReferences": [{"kind": "Node", "uid": "n"}, ref]}})
    assert (info.owner_kind, info.owner_uid) == ("ReplicaSet", RS)
    assert observe_pod({"metadata": {"name": "p", "ownerReferences": [{**ref, "controller": False}]}}).owner_uid == ""
    rs = {"kind": "ReplicaSet", "metadata": {"uid": RS, "name": "x", "ownerReferences": [{**ref, "uid": DEPLOYMENT}]}}
    assert observe_link(rs) == OwnerLink(RS, "ReplicaSet", "x", DEPLOYMENT)


class NoKube:
    def patch_status(self, *a: Any, **k: Any) -> None: ...

    def get(self, *a: Any, **k: Any) -> None:
        return None


def test_the_runtime_probes_only_trusted_pods_and_names_the_others_once_in_a_warning():
    events = []
    rt = Runtime(NoKube(), OperatorConfig(), lambda cr, e: events.append(e))  # type: ignore[arg-type]
    cr = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedModel",
        "metadata": {"name": "m", "namespace": "ns", "uid": MODEL, "generation": 1},
        "spec": {"model": {"hostPath": "/m", "path": "x"}, "image": "img"},
    }
    pods = [pod("m-router-5f7c-a"), pod("forged", kind="", uid="", ip="10.0.0.66")]
    observed = {"router": RoleObservation(1, 1, 1)}
    for _ in range(2):
        rt.refresh_status(cr, observed, [], pods, LINKS)
    assert rt.router_pods() == {MODEL: {"m-router-5f7c-a": "10.0.0.1"}}
    refused = [e for e in events if e.reason == "RouterPodRefused"]
    assert len(refused) == 1 and refused[0].type == "Warning" and refused[0].message.endswith(": forged")
