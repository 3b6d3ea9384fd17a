"""The local control plane behaves like a real cluster where the operator relies on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_operator_support import POLL_S, kube_timeout, wait_until

TESTDATA = Path(__file__).parent / "testdata"
GPU_STATEFULSET = """
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: decode
spec:
  replicas: 2
  serviceName: decode
  selector:
    matchLabels: {app: decode}
  template:
    metadata:
      labels: {app: decode}
    spec:
      containers:
      - name: worker
        image: registry.invalid/worker:1
        resources:
          limits: {nvidia.com/gpu: 4, rdma/ib: 1}
"""


def test_server_reports_the_built_release(kube_cluster):
    version = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"]
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    nodes = kube_cluster.get("nodes")["items"]
    assert len(nodes) >= 2
    for node in nodes:
        assert int(node["status"]["allocatable"]["nvidia.com/gpu"]) > 0
        assert int(node["status"]["allocatable"]["rdma/ib"]) > 0


def test_cel_rule_rejects_invalid_object(kube_cluster, namespace: str):
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    kube_cluster.kubectl("apply", "-f", str(TESTDATA / "crd-widget.yaml"))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", f"--timeout={kube_timeout(30)}", "crd/widgets.test.disagg.dev"
    )
    api = client.CustomObjectsApi(kube_cluster.api_client())
    args = ("test.disagg.dev", "v1", namespace, "widgets")

    def widget(name: str, **spec) -> dict:
        return {"apiVersion": "test.disagg.dev/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}

    created = api.create_namespaced_custom_object(*args, widget("ok", replicas=2, extra="pruned"))
    assert created["spec"] == {"replicas": 2, "minReplicas": 0, "mode": "decode"}

    with pytest.raises(ApiException) as rejected:
        api.create_namespaced_custom_object(*args, widget("bad", replicas=1, minReplicas=3))
    assert rejected.value.status == 422
    assert "minReplicas must not exceed replicas" in rejected.value.body

    by_kubectl = kube_cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", check=False, input=json.dumps(widget("bad", replicas=1, minReplicas=3))
    )
    assert by_kubectl.returncode != 0
    assert "minReplicas must not exceed replicas" in by_kubectl.stderr


def test_statefulset_becomes_ready_and_is_garbage_collected(kube_cluster, namespace: str):
    kube_cluster.kubectl("apply", "-n", namespace, "-f", "-", input=GPU_STATEFULSET)
    kube_cluster.kubectl(
        "-n",
        namespace,
        "wait",
        "statefulset/decode",
        f"--timeout={kube_timeout(60)}",
        "--for=jsonpath={.status.readyReplicas}=2",
    )
    pods = kube_cluster.get("pods", "-n", namespace, "-l", "app=decode")["items"]
    assert sorted(p["metadata"]["name"] for p in pods) == ["decode-0", "decode-1"]
    assert all(p["spec"]["nodeName"].startswith("kwok-") for p in pods)

    # Background cascade: the StatefulSet goes at once, its pods only through
    # the garbage collector following their ownerReferences.
    kube_cluster.kubectl("-n", namespace, "delete", "statefulset/decode", "--cascade=background")
    wait_until(
        lambda: not kube_cluster.get("pods", "-n", namespace, "-l", "app=decode")["items"],
        60,
        POLL_S,
        what="garbage collection of the StatefulSet's pods",
    )


def test_chaos_label_fails_a_chosen_pod(kube_cluster, namespace: str):
    kube_cluster.kubectl("-n", namespace, "run", "victim", "--image=registry.invalid/worker:1", "--restart=Never")
    kube_cluster.kubectl(
        "-n", namespace, "wait", "pod/victim", "--for=condition=Ready", f"--timeout={kube_timeout(60)}"
    )

    kube_cluster.fail_pod(namespace, "victim", reason="OOMKilled", exit_code=137)

    kube_cluster.kubectl(
        "-n", namespace, "wait", "pod/victim", f"--timeout={kube_timeout(60)}", "--for=jsonpath={.status.phase}=Failed"
    )
    status = kube_cluster.get("-n", namespace, "pod/victim")["status"]
    terminated = status["containerStatuses"][0]["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137)


def test_helm_install_and_uninstall(kube_cluster, namespace: str):
    chart = str(TESTDATA / "chart")
    kube_cluster.helm(
        "install", "smoke", chart, "-n", namespace, "--set", "greeting=hi", "--wait", "--timeout", kube_timeout(90)
    )
    config = kube_cluster.get("-n", namespace, "configmap/smoke-config")
    assert config["data"] == {"greeting": "hi"}
    deployment = kube_cluster.get("-n", namespace, "deployment/smoke-server")
    assert deployment["status"]["readyReplicas"] == 1

    kube_cluster.helm("uninstall", "smoke", "-n", namespace, "--wait", "--timeout", kube_timeout(90))
    for obj in ("configmap/smoke-config", "deployment/smoke-server"):
        gone = kube_cluster.kubectl("-n", namespace, "get", obj, check=False)
        assert gone.returncode != 0 and "NotFound" in gone.stderr
    assert "smoke" not in kube_cluster.helm("list", "-n", namespace, "-q").stdout.split()
