"""`spec.kvCache.store` on a real API server: the operator runs Mooncake Store for the model (its Deployment,
Service and NetworkPolicy, owned by the model), tells every worker where it is, reports its pod in
`status.kvStore`, and deletes all three when the store leaves the spec, the workers keeping their host tier.

kwok plays the kubelets: the store's pod becomes Ready without running Mooncake.
"""

from __future__ import annotations

import json

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

STORE = "tiny-kvstore"
STORE_KINDS = ("deployment", "service", "networkpolicy")


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


def tiny_with_store() -> dict:
    cr = load_example("dm-cpu-tcp.yaml")
    for role in ("prefill", "decode"):
        cr["spec"][role]["resources"] = {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}
    cr["spec"]["kvCache"] = {"prefill": {"hostSize": "1Gi"}, "store": {"memory": "2Gi"}}
    return cr


def store_children(cluster, namespace: str) -> dict[str, dict | None]:
    out = {}
    for kind in STORE_KINDS:
        proc = cluster.kubectl("-n", namespace, "get", kind, STORE, "-o", "json", "--ignore-not-found")
        out[kind] = json.loads(proc.stdout) if proc.stdout.strip() else None
    return out


def worker_args(cluster, namespace: str, role: str) -> list[str]:
    sts = cluster.get("-n", namespace, "statefulset", f"tiny-{role}")
    return sts["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_store_is_run_for_the_model_and_removed_with_it(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, tiny_with_store())
    made = wait_until(
        lambda: (lambda c: c if all(c.values()) else None)(store_children(kube_cluster, namespace)),
        60,
        POLL_S,
        what="the kvstore's Deployment, Service and NetworkPolicy",
    )
    uid = kube_cluster.get("-n", namespace, "dm", "tiny")["metadata"]["uid"]
    for obj in made.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"] == "kvstore"
    master, store = made["deployment"]["spec"]["template"]["spec"]["containers"]
    assert master["command"] == ["mooncake_master"] and store["command"] == ["mooncake_client"]
    assert store["resources"]["limits"]["memory"] == "2560Mi"  # 2Gi of segment and 512Mi for the process
    assert [p["port"] for p in made["service"]["spec"]["ports"]] == [50051, 8080]
    ports = [(p["port"], p.get("endPort")) for r in made["networkpolicy"]["spec"]["ingress"] for p in r["ports"]]
    assert ports == [(50051, None), (8080, None), (17100, 17107)]

    master_at = f"tiny-kvstore.{namespace}.svc:50051"
    for role in ("prefill", "decode"):
        args = worker_args(kube_cluster, namespace, role)
        assert args[args.index("--hicache-store-master") + 1] == master_at
        assert args[args.index("--hicache-storage-backend") + 1] == "mooncake"
    prefill = kube_cluster.get("-n", namespace, "statefulset", "tiny-prefill")["spec"]["template"]["spec"]
    assert prefill["containers"][0]["resources"]["limits"]["memory"] == "3Gi"  # 2Gi and the 1Gi host tier

    kube_cluster.kubectl(
        "-n",
        namespace,
        "wait",
        "--for=jsonpath={.status.kvStore.ready}=1/1",
        "dm/tiny",
        f"--timeout={kube_timeout(120)}",
    )
    kube_cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", "dm/tiny", f"--timeout={kube_timeout(120)}")

    kube_cluster.kubectl(
        "-n", namespace, "patch", "dm", "tiny", "--type=json", "-p", '[{"op": "remove", "path": "/spec/kvCache/store"}]'
    )
    wait_until(
        lambda: not any(store_children(kube_cluster, namespace).values()),
        60,
        POLL_S,
        what="the kvstore's children deleted",
    )
    wait_until(
        lambda: "--hicache-store-master" not in worker_args(kube_cluster, namespace, "decode"),
        60,
        POLL_S,
        what="the workers' store flags gone",
    )
    assert "--enable-hierarchical-cache" in worker_args(kube_cluster, namespace, "decode")  # the host tier stays
    wait_until(
        lambda: "kvStore" not in kube_cluster.get("-n", namespace, "dm", "tiny").get("status", {}),
        60,
        POLL_S,
        what="status.kvStore removed",
    )
    assert not any(store_children(kube_cluster, namespace).values())  # and not made again


def test_a_store_deleted_by_hand_is_made_again(kube_cluster, operator, namespace):
    apply_cr(kube_cluster, namespace, tiny_with_store())
    wait_until(lambda: store_children(kube_cluster, namespace)["deployment"], 60, POLL_S, what="the kvstore")
    kube_cluster.kubectl("-n", namespace, "delete", "deployment", STORE, "--wait=true")
    wait_until(lambda: store_children(kube_cluster, namespace)["deployment"], 60, POLL_S, what="the kvstore again")
