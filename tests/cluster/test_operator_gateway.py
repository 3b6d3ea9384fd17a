"""`spec.gateway` on a real API server with the Gateway API v1.6.3 CRDs and the InferencePool CRD the chart ships:
the model gets its InferencePool, its endpoint picker's Deployment, Service and ServiceAccount (granted no API access),
the NetworkPolicies and the HTTPRoute, each accepted by the API server and owned by the model, and status.gateway
names them; removing the block deletes them all. Without the InferencePool CRD the model is Degraded naming it (a
Warning Event too) while the rest of it reconciles and gets Ready; installing the CRD heals it.

The CRDs are cluster-wide: the first test removes the InferencePool CRD, the module installs it after, and the
module's end deletes every CRD it installed, so the other modules see the cluster they always did.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_operator_support import (
    CHART,
    POLL_S,
    OperatorUnderTest,
    apply_cr,
    condition,
    events_for,
    install_chart,
    kube_timeout,
    load_example,
    wait_until,
)

HERE = Path(__file__).resolve().parent
POOL_CRD = CHART / "files" / "inference.networking.k8s.io_inferencepools.yaml"
GATEWAY_API = HERE / "testdata" / "gateway-api-v1.6.3"
CRDS = [
    "inferencepools.inference.networking.k8s.io",
    *(f"{p}.gateway.networking.k8s.io" for p in ("gatewayclasses", "gateways", "httproutes", "referencegrants")),
]
# kind -> name of what spec.gateway makes for the model `tiny`.
MADE = {
    "inferencepool": "tiny",
    "httproute": "tiny",
    "deployment": "tiny-epp",
    "service": "tiny-epp",
    "serviceaccount": "tiny-epp",
    "poddisruptionbudget": "tiny-epp",
    "networkpolicy": "tiny-epp",
}
ROUTE = {"parentRefs": [{"name": "inference-gateway"}], "hostnames": ["tiny.example.com"]}


def delete_crds(cluster) -> None:
    cluster.kubectl("delete", "crd", *CRDS, "--ignore-not-found", f"--timeout={kube_timeout(60)}")


def install_crds(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(POOL_CRD), "-f", str(GATEWAY_API))
    for crd in CRDS:
        cluster.kubectl("wait", "--for=condition=Established", f"--timeout={kube_timeout(60)}", f"crd/{crd}")


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    delete_crds(kube_cluster)  # a reused cluster may hold them from an earlier run
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()
    delete_crds(kube_cluster)


def tiny_with_gateway(**gateway) -> dict:
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["gateway"] = gateway
    return cr


def get(cluster, namespace: str, kind: str, name: str) -> dict | None:
    proc = cluster.kubectl("-n", namespace, "get", kind, name, "-o", "json", "--ignore-not-found")
    return json.loads(proc.stdout) if proc.stdout.strip() else None


def made(cluster, namespace: str, kinds=MADE) -> dict[str, dict | None]:
    return {kind: get(cluster, namespace, kind, name) for kind, name in kinds.items()}


def model(cluster, namespace: str) -> dict:
    return cluster.get("-n", namespace, "dm", "tiny")


def test_without_the_inferencepool_crd_the_model_is_degraded_naming_it_and_serves_until_it_is_installed(
    kube_cluster, operator, namespace
):
    apply_cr(kube_cluster, namespace, tiny_with_gateway())
    degraded = wait_until(
        lambda: (lambda c: c if c.get("reason") == "GatewayUnavailable" else None)(
            condition(kube_cluster, namespace, "tiny", "Degraded")
        ),
        120,
        POLL_S,
        what=f"Degraded GatewayUnavailable (log: {operator.log_path})",
    )
    assert degraded["status"] == "True"
    assert "InferencePool is not installed" in degraded["message"]
    assert "inferencepools.inference.networking.k8s.io" in degraded["message"]
    # The rest of the model reconciles: its workers and router are made and it is Ready.
    kube_cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", "dm/tiny", f"--timeout={kube_timeout(120)}")
    assert get(kube_cluster, namespace, "statefulset", "tiny-decode") is not None
    warned = [e for e in events_for(kube_cluster, namespace, "tiny") if e["reason"] == "GatewayUnavailable"]
    assert warned and warned[0]["type"] == "Warning" and "inferencepools" in warned[0]["message"]

    install_crds(kube_cluster)  # the retry makes the pool, and the model is whole again
    wait_until(
        lambda: get(kube_cluster, namespace, "inferencepool", "tiny"),
        120,
        POLL_S,
        what="the InferencePool once installed",
    )
    wait_until(
        lambda: condition(kube_cluster, namespace, "tiny", "Degraded").get("status") == "False",
        120,
        POLL_S,
        what="Degraded cleared",
    )


def test_the_gateway_objects_are_made_owned_and_reported_then_removed_with_the_block(kube_cluster, operator, namespace):
    install_crds(kube_cluster)  # idempotent: the first test installed them
    apply_cr(kube_cluster, namespace, tiny_with_gateway(failureMode="FailOpen", httpRoute=ROUTE))
    objs = wait_until(
        lambda: (lambda c: c if all(c.values()) else None)(made(kube_cluster, namespace)),
        120,
        POLL_S,
        what=f"the gateway's objects (log: {operator.log_path})",
    )
    uid = model(kube_cluster, namespace)["metadata"]["uid"]
    for kind, obj in objs.items():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"]) == (uid, True), kind
    pool = objs["inferencepool"]["spec"]
    assert pool["selector"]["matchLabels"] == {"disagg.dev/model": "tiny", "disagg.dev/role": "decode"}
    assert pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"]["name"] == "tiny-epp" and pool["endpointPickerRef"]["port"] == {"number": 9002}
    assert pool["endpointPickerRef"]["failureMode"] == "FailOpen"
    route = objs["httproute"]["spec"]
    assert route["hostnames"] == ["tiny.example.com"]
    assert route["rules"][0]["backendRefs"][0]["kind"] == "InferencePool"
    assert route["rules"][0]["backendRefs"][0]["name"] == "tiny"
    args = objs["deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "epp" and args[args.index("--endpoint-dns") + 1].startswith(f"tiny-decode.{namespace}.svc.")
    assert args[args.index("--prefill-dns") + 1].startswith(f"tiny-prefill.{namespace}.svc.")
    # The picker makes no API call: its account mounts no token and may read nothing, not even its own pool.
    assert objs["serviceaccount"]["automountServiceAccountToken"] is False
    picker = f"system:serviceaccount:{namespace}:tiny-epp"
    for verb, what in (("list", "pods"), ("get", "inferencepools.inference.networking.k8s.io")):
        can = kube_cluster.kubectl("auth", "can-i", "--as", picker, verb, what, "-n", namespace, check=False)
        assert can.stdout.strip() == "no", (verb, what)
    assert get(kube_cluster, namespace, "networkpolicy", "tiny-gateway") is not None
    assert get(kube_cluster, namespace, "networkpolicy", "tiny-gateway-prefill") is not None

    gateway = wait_until(
        lambda: (lambda g: g if g and g.get("ready") == "1/1" else None)(
            model(kube_cluster, namespace).get("status", {}).get("gateway")
        ),
        120,
        POLL_S,
        what="status.gateway with the picker ready",
    )
    assert gateway["pool"] == "tiny" and gateway["httpRoute"] == "tiny"
    assert gateway["endpointPicker"] == f"tiny-epp.{namespace}.svc:9002"
    assert condition(kube_cluster, namespace, "tiny", "Degraded").get("status") == "False"

    kube_cluster.kubectl(
        "-n", namespace, "patch", "dm", "tiny", "--type=json", "-p", '[{"op": "remove", "path": "/spec/gateway"}]'
    )
    wait_until(
        lambda: not any(made(kube_cluster, namespace).values()), 120, POLL_S, what="the gateway's objects deleted"
    )
    assert get(kube_cluster, namespace, "networkpolicy", "tiny-gateway") is None
    assert get(kube_cluster, namespace, "networkpolicy", "tiny-gateway-prefill") is None
    wait_until(
        lambda: "gateway" not in model(kube_cluster, namespace).get("status", {}),
        60,
        POLL_S,
        what="status.gateway removed",
    )
