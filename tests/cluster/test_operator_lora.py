"""`spec.lora` on a real API server: both roles' StatefulSets get the same `--lora-modules` and the adapters'
read-only volumes (a ConfigMap, a PVC's directory, a node directory), which the API server takes; the model is
Ready once both roles are; removing the block rolls both roles back to the base model alone.

kwok plays the kubelets: the pods become Ready without running the worker (a real worker refuses its start-up
when an adapter does not load, and the operator's Ready also waits for the routers to see a healthy pair serving
each adapter: tests/unit/test_operator_lora.py, tests/integration/test_lora_pd.py).
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

ADAPTERS = [
    {"name": "sql", "configMap": "sql-adapter"},
    {"name": "chat", "pvc": "adapters", "path": "chat/v2"},
    {"name": "med", "hostPath": "/srv/adapters/med"},
]
MODULES = ["sql=/lora/sql", "chat=/lora/chat", "med=/lora/med"]


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


@pytest.fixture
def adapter_claim(kube_cluster, namespace):
    """The PVC `adapters`, statically bound to a hostPath PV (removed after), so that the pods can be scheduled."""
    pv = f"adapters-{namespace}"
    kube_cluster.kubectl("apply", "-f", "-", input=claim_manifest(pv, namespace))
    yield
    kube_cluster.kubectl("delete", "pv", pv, "--wait=false", check=False)


def claim_manifest(pv: str, namespace: str) -> str:
    return f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {pv}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  hostPath: {{path: /srv/adapters}}
  claimRef: {{namespace: {namespace}, name: adapters}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: adapters, namespace: {namespace}}}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: {pv}
  resources: {{requests: {{storage: 1Gi}}}}
"""


def pod_spec(cluster, namespace: str, role: str) -> dict:
    return cluster.get("-n", namespace, "statefulset", f"tiny-{role}")["spec"]["template"]["spec"]


def lora_modules(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--lora-modules"]


def test_both_roles_serve_the_same_adapters_from_their_volumes_and_lose_them_with_the_block(
    kube_cluster, operator, namespace, adapter_claim
):
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["lora"] = {"adapters": ADAPTERS, "maxLoras": 2}
    apply_cr(kube_cluster, namespace, cr)
    kube_cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", "dm/tiny", f"--timeout={kube_timeout(120)}")
    for role in ("prefill", "decode"):
        spec = pod_spec(kube_cluster, namespace, role)
        args = spec["containers"][0]["args"]
        assert lora_modules(args) == MODULES, role
        assert args[args.index("--max-loras") + 1] == "2"
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts["/lora/sql"]["name"]]["configMap"]["name"] == "sql-adapter"
        assert volumes[mounts["/lora/chat"]["name"]]["persistentVolumeClaim"]["claimName"] == "adapters"
        assert mounts["/lora/chat"]["subPath"] == "chat/v2"
        assert volumes[mounts["/lora/med"]["name"]]["hostPath"]["path"] == "/srv/adapters/med"
        assert all(mounts[f"/lora/{a['name']}"]["readOnly"] for a in ADAPTERS)
    revisions = {
        kube_cluster.get("-n", namespace, "statefulset", f"tiny-{role}")["spec"]["template"]["metadata"]["labels"][
            names.REVISION_LABEL
        ]
        for role in ("prefill", "decode")
    }
    assert len(revisions) == 1  # one pairing revision: the router pairs them

    kube_cluster.kubectl(
        "-n", namespace, "patch", "dm", "tiny", "--type=json", "-p", '[{"op": "remove", "path": "/spec/lora"}]'
    )
    for role in ("prefill", "decode"):
        wait_until(
            lambda role=role: not lora_modules(pod_spec(kube_cluster, namespace, role)["containers"][0]["args"]),
            60,
            POLL_S,
            what=f"{role}'s --lora-modules gone",
        )
        assert not any(v["name"].startswith("lora-") for v in pod_spec(kube_cluster, namespace, role)["volumes"])
    kube_cluster.kubectl("-n", namespace, "wait", "--for=condition=Ready", "dm/tiny", f"--timeout={kube_timeout(120)}")
