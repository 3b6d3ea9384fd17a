"""Instances that span nodes, on a real API server with the LeaderWorkerSet controller running (hack/k8s/lws.sh):
a decode of two ranks on one-GPU nodes becomes a LeaderWorkerSet whose groups get the leader's address and their
pod's index from LWS's webhook; the router's Service finds only the leaders; scaling, an image rollout and a lost
pod all go through LWS, the last by recreating the whole group. A prefill that spans nodes follows decode in groups
under prefillPerDecode, its RoleScaler selecting the leaders.

kwok plays the kubelets: pods are Running and Ready at once (their containers never run).
"""

from __future__ import annotations

import pytest
from test_operator_support import (
    POLL_S,
    OperatorUnderTest,
    apply_cr,
    install_chart,
    kube_timeout,
    load_example,
    wait_until,
)

from disagg_operator import names

GROUP = "tiny-decode-group"


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


def spanning(decode: int, **spec) -> dict:
    """One prefill pod; `decode` decode instances of two ranks, one per one-GPU node: two pods each."""
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["prefill"]["replicas"] = 1
    cr["spec"]["decode"].update(replicas=decode, tpSize=2, gpusPerNode=1)
    for role in ("prefill", "decode"):
        cr["spec"][role].pop("resources", None)
    cr["spec"].update(spec)
    return cr


def group_pods(cluster, namespace: str) -> dict[str, dict]:
    pods = cluster.get("-n", namespace, "pods", "-l", f"{names.LWS_NAME_LABEL}={GROUP}")["items"]
    return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0].get("env", [])}


def leader_uid(cluster, namespace: str) -> str:
    """Group 1's leader as it stands now ("" while it is gone or being deleted)."""
    pods = cluster.get("-n", namespace, "pods", "-l", f"{names.LWS_NAME_LABEL}={GROUP}")["items"]
    found = [p for p in pods if p["metadata"]["name"] == f"{GROUP}-1" and not p["metadata"].get("deletionTimestamp")]
    return found[0]["metadata"]["uid"] if found else ""


def ready(cluster, namespace: str) -> bool:
    dm = cluster.get("-n", namespace, "dm", "tiny")
    conds = {c["type"]: c for c in dm.get("status", {}).get("conditions", [])}
    current = dm.get("status", {}).get("observedGeneration") == dm["metadata"]["generation"]
    return current and conds.get("Ready", {}).get("status") == "True" and "rollout" not in dm["status"]


def test_a_decode_that_spans_nodes_runs_as_leaderworkerset_groups(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, spanning(1))
    kube_cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", "dm/tiny", f"--timeout={kube_timeout(120)}")
    assert (
        kube_cluster.get("-n", namespace, "statefulsets", "-l", "disagg.dev/model=tiny,disagg.dev/role=decode")["items"]
        == []
    )
    lws = kube_cluster.get("-n", namespace, "leaderworkersets", GROUP)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"

    # LWS's webhook told each pod where the leader is and which pod it is.
    pods = wait_until(
        lambda: (p := group_pods(kube_cluster, namespace)) and len(p) == 2 and p,
        60,
        POLL_S,
        what="the group's two pods",
    )
    assert set(pods) == {f"{GROUP}-0", f"{GROUP}-0-1"}
    leader, worker = env_of(pods[f"{GROUP}-0"]), env_of(pods[f"{GROUP}-0-1"])
    assert leader["LWS_LEADER_ADDRESS"] == worker["LWS_LEADER_ADDRESS"] == f"{GROUP}-0.{GROUP}.{namespace}"
    assert (leader["LWS_WORKER_INDEX"], worker["LWS_WORKER_INDEX"]) == ("0", "1")
    assert leader["LWS_GROUP_SIZE"] == "2"
    args = pods[f"{GROUP}-0-1"]["spec"]["containers"][0]["args"]
    assert args[args.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"  # the kubelet expands it from that env
    # LWS's own headless Service publishes not-ready pods (ranks meet before anyone is Ready); the router's
    # Service lists only the leaders, the pods that serve HTTP.
    assert kube_cluster.get("-n", namespace, "service", GROUP)["spec"]["publishNotReadyAddresses"] is True
    leader_ip = pods[f"{GROUP}-0"]["status"]["podIP"]
    slices = kube_cluster.get("-n", namespace, "endpointslices", "-l", "kubernetes.io/service-name=tiny-decode")
    addresses = {a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]}
    assert addresses == {leader_ip}
    dm = kube_cluster.get("-n", namespace, "dm", "tiny")
    assert dm["status"]["decode"]["readyReplicas"] == 1

    # Scaling the model scales the groups.
    apply_cr(kube_cluster, namespace, spanning(2))
    wait_until(
        lambda: set(group_pods(kube_cluster, namespace)) == {f"{GROUP}-{g}{w}" for g in (0, 1) for w in ("", "-1")},
        90,
        POLL_S,
        what="a second group of two pods",
    )
    wait_until(lambda: ready(kube_cluster, namespace), 90, POLL_S, what="the model Ready with two decode groups")
    assert kube_cluster.get("-n", namespace, "dm", "tiny")["status"]["decode"]["readyReplicas"] == 2

    # A lost pod takes its whole group down: LWS recreates the leader too; the other group is untouched. A finalizer
    # holds the deleted pod in its terminating state (kwok would remove it at once) until LWS has acted on it.
    before = {n: p["metadata"]["uid"] for n, p in group_pods(kube_cluster, namespace).items()}
    hold = '{"metadata":{"finalizers":["disagg.test/hold"]}}'
    kube_cluster.kubectl("-n", namespace, "patch", "pod", f"{GROUP}-1-1", "--type=merge", "-p", hold)
    kube_cluster.kubectl("-n", namespace, "delete", "pod", f"{GROUP}-1-1", "--wait=false")
    wait_until(
        lambda: leader_uid(kube_cluster, namespace) != before[f"{GROUP}-1"],
        90,
        POLL_S,
        what="LWS deleting the group's leader",
    )
    kube_cluster.kubectl(
        "-n",
        namespace,
        "patch",
        "pod",
        f"{GROUP}-1-1",
        "--type=merge",
        "-p",
        '{"metadata":{"finalizers":null}}',
        check=False,
    )

    def group_recreated() -> bool:
        now = {n: p["metadata"]["uid"] for n, p in group_pods(kube_cluster, namespace).items()}
        return (
            len(now) == 4
            and now[f"{GROUP}-1"] != before[f"{GROUP}-1"]
            and now[f"{GROUP}-1-1"] != before[f"{GROUP}-1-1"]
        )

    wait_until(group_recreated, 90, POLL_S, what="group 1 recreated, its leader included")
    after = {n: p["metadata"]["uid"] for n, p in group_pods(kube_cluster, namespace).items()}
    assert after[f"{GROUP}-0"] == before[f"{GROUP}-0"] and after[f"{GROUP}-0-1"] == before[f"{GROUP}-0-1"]

    # An image rollout goes through LWS's partition; every pod of every group ends on the new image.
    image = "ghcr.io/disagg/worker:0.2.0"
    wait_until(lambda: ready(kube_cluster, namespace), 90, POLL_S, what="the model Ready again")
    apply_cr(kube_cluster, namespace, spanning(2, image=image))

    def rolled() -> bool:
        pods = group_pods(kube_cluster, namespace).values()
        return len(pods) == 4 and {p["spec"]["containers"][0]["image"] for p in pods} == {image}

    wait_until(lambda: rolled() and ready(kube_cluster, namespace), 180, POLL_S, what="the rollout to finish")
    lws = kube_cluster.get("-n", namespace, "leaderworkersets", GROUP)
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]["partition"] == 0


def test_with_prefill_per_decode_a_prefill_that_spans_nodes_follows_decode_in_groups(kube_cluster, operator, namespace):
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["prefill"].update(replicas=1, tpSize=2, gpusPerNode=1)
    cr["spec"]["decode"]["replicas"] = 2
    for role in ("prefill", "decode"):
        cr["spec"][role].pop("resources", None)
    cr["spec"]["scaling"] = {"prefillPerDecode": 0.5}
    apply_cr(kube_cluster, namespace, cr)
    wait_until(lambda: ready(kube_cluster, namespace), 120, POLL_S, what="the model Ready with one prefill group")
    prefill = "tiny-prefill-group"
    assert kube_cluster.get("-n", namespace, "leaderworkersets", prefill)["spec"]["replicas"] == 1

    kube_cluster.kubectl("-n", namespace, "scale", "dm/tiny", "--replicas=4")
    wait_until(
        lambda: kube_cluster.get("-n", namespace, "leaderworkersets", prefill)["spec"]["replicas"] == 2,
        30,
        POLL_S,
        what="two prefill groups for four decodes",
    )
    wait_until(lambda: ready(kube_cluster, namespace), 120, POLL_S, what="the model Ready with two prefill groups")
    pods = kube_cluster.get("-n", namespace, "pods", "-l", f"{names.LWS_NAME_LABEL}={prefill}")["items"]
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{prefill}-{g}{w}" for g in (0, 1) for w in ("", "-1")]
    status = kube_cluster.get("-n", namespace, "dm", "tiny")["status"]
    assert (status["prefill"]["ready"], status["decode"]["ready"]) == ("2/2", "4/4")
    # The prefill RoleScaler counts groups: its selector finds the leaders only (an HPA reads it).
    scaler = wait_until(
        lambda: (
            (s := kube_cluster.get("-n", namespace, "rolescaler", "tiny-prefill"))["status"].get("replicas") == 2 and s
        ),
        30,
        POLL_S,
        what="the prefill RoleScaler's status at two groups",
    )
    assert scaler["spec"]["replicas"] == 2
    leaders = kube_cluster.get("-n", namespace, "pods", "-l", scaler["status"]["selector"])["items"]
    assert sorted(p["metadata"]["name"] for p in leaders) == [f"{prefill}-0", f"{prefill}-1"]
