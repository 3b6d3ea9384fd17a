"""The operator against a real API server: install, reconcile, status, scaling, failures, restarts, deletion.

The operator runs as a local process with the chart's ServiceAccount token (so the chart's RBAC must suffice);
kwok plays the kubelets, so pods become Ready without running the worker.
"""

from __future__ import annotations

import json
import time

import pytest
from test_operator_support import (
    EXAMPLES,
    OPERATOR_NS,
    POLL_S,
    RELEASE,
    CountingProxy,
    OperatorUnderTest,
    apply_cr,
    condition,
    events_for,
    install_chart,
    kube_timeout,
    load_example,
    scaled,
    wait_until,
)

from disagg_operator import names
from disagg_operator.config import OperatorConfig
from disagg_operator.observe import observe_link, observe_pod
from disagg_operator.router_trust import router_targets

CHILD_KINDS = "statefulsets,deployments,services,poddisruptionbudgets,networkpolicies,secrets"
# What the operator watches besides its CRs: the children but the Secret, their pods, the RoleScaler.
WATCHED_KINDS = "statefulsets,deployments,services,poddisruptionbudgets,networkpolicies,pods,rolescalers"
WRITTEN_CHILD_KINDS = {*CHILD_KINDS.split(","), "rolescalers"}  # a write to one of these makes or changes a child
TICK_S = OperatorConfig().tick_s  # the operator's clock, as the chart runs it


@pytest.fixture(scope="module")
def operator(kube_cluster, tmp_path_factory):
    install_chart(kube_cluster)
    op = OperatorUnderTest(kube_cluster, tmp_path_factory.mktemp("operator"))
    op.start()
    yield op
    op.stop()


def children(cluster, namespace: str, name: str) -> list[dict]:
    return cluster.get("-n", namespace, CHILD_KINDS, "-l", f"disagg.dev/model={name}")["items"]


def provide_models_volume(cluster, namespace: str) -> None:
    """The PVC `models` the GPU example mounts, statically bound to a hostPath PV."""
    pv = f"models-{namespace}"
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {pv}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadOnlyMany]
  persistentVolumeReclaimPolicy: Delete
  storageClassName: ""
  hostPath: {{path: /var/lib/models}}
  claimRef: {{namespace: {namespace}, name: models}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: models, namespace: {namespace}}}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: {pv}
  resources: {{requests: {{storage: 1Gi}}}}
""",
    )


def wait_ready(cluster, namespace: str, name: str, timeout: float = 120) -> None:
    cluster.kubectl(
        "-n", namespace, "wait", "--for=condition=Ready", f"dm/{name}", f"--timeout={kube_timeout(timeout)}"
    )


def event_with(cluster, namespace: str, name: str, reason: str) -> dict:
    """The first Event of `reason` about the CR. The operator posts Events through a queue after the status
    write that caused them: a test that saw the status waits for the Event."""
    return wait_until(
        lambda: next((e for e in events_for(cluster, namespace, name) if e["reason"] == reason), None),
        30,
        interval=POLL_S,
        what=f"a {reason} Event",
    )


def quiet(proxy: CountingProxy, seconds: float):
    """A predicate for `wait_until`: true once the proxy has passed no watch event to the operator and seen no
    write from it for `seconds` (scaled). What the operator does follows an event or a tick, so after a quiet
    spell it has finished what the events before it asked for."""
    spell = scaled(seconds)
    last: dict = {"state": None, "since": time.monotonic()}

    def check() -> bool:
        state = (proxy.write_mark(), len(proxy.delivered()))
        if state != last["state"]:
            last["state"], last["since"] = state, time.monotonic()
        return time.monotonic() - last["since"] >= spell

    return check


def test_the_service_account_can_do_what_the_operator_needs_and_no_more(kube_cluster, operator):
    sa = f"system:serviceaccount:{OPERATOR_NS}:{RELEASE}"

    def can(*args: str) -> bool:
        return kube_cluster.kubectl("auth", "can-i", "--as", sa, *args, check=False).stdout.strip() == "yes"

    assert can("patch", "statefulsets", "-n", "default") and can("create", "networkpolicies", "-n", "default")
    assert can("patch", "disaggregatedmodels.disagg.dev/status", "-n", "default")
    assert can("watch", "replicasets", "-n", "default") and not can("create", "replicasets", "-n", "default")
    assert not can("delete", "statefulsets", "-n", "default")
    assert not can("list", "secrets", "-n", "default")
    assert not can("create", "clusterroles")


@pytest.mark.parametrize(
    "example,name,expected",
    [
        ("dm-cpu-tcp.yaml", "tiny", ["1/1", "1/1", "1/1"]),
        ("dm-rdma-gpu.yaml", "llama-8b", ["1/1", "2/2", "2/2"]),
    ],
)
def test_example_becomes_ready_with_owned_children(kube_cluster, operator, namespace, example, name, expected):
    if "pvc:" in (EXAMPLES / example).read_text():
        provide_models_volume(kube_cluster, namespace)
    kube_cluster.kubectl("-n", namespace, "apply", "-f", f"examples/{example}")
    wait_ready(kube_cluster, namespace, name)
    # Ready: the reconcile that made the workloads had applied every other child before them, so each child
    # is here now (4 Services, 2 StatefulSets, a Deployment, 3 PDBs, 3 NetworkPolicies, the auth Secret).
    made = children(kube_cluster, namespace, name)
    assert len(made) >= 14, [(c["kind"], c["metadata"]["name"]) for c in made]
    uid = kube_cluster.get("-n", namespace, "dm", name)["metadata"]["uid"]
    for child in made:
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, child["metadata"]["name"]
    row = kube_cluster.kubectl("-n", namespace, "get", "dm", name, "--no-headers").stdout.split()
    assert row[:5] == [name, "True", *expected]
    assert row[5] == f"http://{name}-router.{namespace}.svc:8000"
    assert event_with(kube_cluster, namespace, name, "AllReplicasReady")["type"] == "Normal"
    # The pods carry llm-d's labels, so that llm-d's picker and sidecar find the roles (the API server keeps them).
    for role in ("prefill", "decode"):
        pods = kube_cluster.get("-n", namespace, "pods", "-l", f"disagg.dev/model={name},disagg.dev/role={role}")
        assert pods["items"], role
        for pod in pods["items"]:
            assert pod["metadata"]["labels"]["llm-d.ai/role"] == role
            assert pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "sglang"


def test_scaling_decode_with_kubectl_scale(kube_cluster, operator, namespace):
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "examples/dm-cpu-tcp.yaml")
    wait_ready(kube_cluster, namespace, "tiny")
    for replicas in (3, 1):
        kube_cluster.kubectl("-n", namespace, "scale", "dm/tiny", f"--replicas={replicas}")
        wait_until(
            lambda r=replicas: kube_cluster.get("-n", namespace, "sts", "tiny-decode")["spec"]["replicas"] == r,
            30,
            interval=POLL_S,
            what=f"StatefulSet at {replicas}",
        )
        wait_until(
            lambda r=replicas: (
                kube_cluster.get("-n", namespace, "dm", "tiny")["status"]["decode"]["ready"] == f"{r}/{r}"
            ),
            60,
            interval=POLL_S,
            what=f"status decode {replicas}/{replicas}",
        )
        wait_ready(kube_cluster, namespace, "tiny")
    scale = kube_cluster.get("-n", namespace, "--subresource=scale", "dm", "tiny")
    assert scale["status"]["replicas"] == 1
    assert scale["status"]["selector"] == "disagg.dev/model=tiny,disagg.dev/role=decode"


def test_a_failing_pod_degrades_and_recovery_clears_it(kube_cluster, operator, namespace):
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "examples/dm-cpu-tcp.yaml")
    wait_ready(kube_cluster, namespace, "tiny")
    kube_cluster.fail_pod(namespace, "tiny-decode-0")
    # kwok fails the pod, the StatefulSet replaces it and kwok makes the new one ready within about a second:
    # the Events record the Degraded episode, the condition must end False.

    def episode() -> tuple[dict, dict] | None:
        events = events_for(kube_cluster, namespace, "tiny")  # oldest first
        failing = next((i for i, e in enumerate(events) if e["reason"] == "PodFailing"), None)
        if failing is None:
            return None
        recovery = next((e for e in events[failing + 1 :] if e["reason"] == "AsExpected"), None)
        return (events[failing], recovery) if recovery else None

    failing, recovered = wait_until(episode, 90, interval=POLL_S, what="PodFailing then AsExpected events")
    assert failing["type"] == "Warning"
    assert failing["message"] == ("Degraded=True: decode pod tiny-decode-0: container decode: Error (exit code 1)")
    assert recovered["type"] == "Normal" and recovered["message"].startswith("Degraded=False")
    wait_ready(kube_cluster, namespace, "tiny")
    assert condition(kube_cluster, namespace, "tiny", "Degraded")["status"] == "False"


def test_a_child_deleted_by_hand_is_recreated(kube_cluster, operator, namespace):
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "examples/dm-cpu-tcp.yaml")
    wait_ready(kube_cluster, namespace, "tiny")
    targets = [("sts", "tiny-decode"), ("svc", "tiny-prefill"), ("networkpolicy", "tiny-prefill")]

    def uid(kind: str, name: str) -> str:
        return kube_cluster.kubectl(
            "-n", namespace, "get", kind, name, "-o", "jsonpath={.metadata.uid}", check=False
        ).stdout

    old = {t: uid(*t) for t in targets}
    for kind, name in targets:
        kube_cluster.kubectl("-n", namespace, "delete", kind, name)
    wait_until(
        lambda: all(uid(*t) not in ("", old[t]) for t in targets), 30, interval=POLL_S, what="recreated children"
    )
    wait_ready(kube_cluster, namespace, "tiny")


def test_killed_mid_reconcile_the_operator_converges_after_restart(kube_cluster, operator, namespace):
    """The API server takes three of the children, then the operator dies with the next one's write in flight."""
    kinds = frozenset(CHILD_KINDS.split(","))
    operator.proxy.hold_writes(kinds, after=3, namespace=namespace)
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "examples/dm-cpu-tcp.yaml")
    wait_until(lambda: operator.proxy.held() > 3, 60, what="a child's write held")
    operator.kill()
    operator.proxy.drop_held()
    made = children(kube_cluster, namespace, "tiny")
    assert 1 <= len(made) <= 3, [c["metadata"]["name"] for c in made]  # the reconcile was cut short
    kube_cluster.kubectl(
        "-n", namespace, "patch", "dm", "tiny", "--type=merge", "-p", '{"spec":{"prefill":{"replicas":2}}}'
    )
    operator.start()

    def prefill_replicas() -> str:
        return kube_cluster.kubectl(
            "-n", namespace, "get", "sts", "tiny-prefill", "-o", "jsonpath={.spec.replicas}", check=False
        ).stdout

    wait_until(lambda: prefill_replicas() == "2", 60, interval=POLL_S, what="prefill StatefulSet at 2")
    wait_ready(kube_cluster, namespace, "tiny")
    assert kube_cluster.get("-n", namespace, "dm", "tiny")["status"]["prefill"]["ready"] == "2/2"


def test_deleting_the_cr_leaves_no_orphans(kube_cluster, operator, namespace):
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "examples/dm-cpu-tcp.yaml")
    wait_ready(kube_cluster, namespace, "tiny")
    selector = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY},{names.MODEL_LABEL}=tiny"  # what the operator watches
    watched = {
        (o["kind"], o["metadata"]["name"])
        for o in kube_cluster.get("-n", namespace, WATCHED_KINDS, "-l", selector)["items"]
    }
    assert {("StatefulSet", "tiny-decode"), ("Pod", "tiny-decode-0"), ("RoleScaler", "tiny-prefill")} <= watched
    mark = operator.proxy.write_mark()
    kube_cluster.kubectl("-n", namespace, "delete", "dm", "tiny")

    def gone() -> bool:
        pods = kube_cluster.get("pods", "-n", namespace, "-l", "disagg.dev/model=tiny")["items"]
        return not children(kube_cluster, namespace, "tiny") and not pods

    wait_until(gone, 90, interval=POLL_S, what="children garbage-collected")

    # The operator must not bring any of them back. It has had its chance once every deletion has reached it:
    # wait until the proxy has passed it the DELETED event of each object it watched, then leave its handlers a
    # window to act. A handler is dispatched as its event arrives and writes within a second on a quiet
    # machine; 5 s (scaled) leave room for a loaded one.
    def untold() -> set[tuple[str, str]]:
        return watched - {(e.kind, e.name) for e in operator.proxy.delivered("DELETED", namespace)}

    wait_until(lambda: not untold(), 60, what="the DELETED events passed to the operator")
    time.sleep(scaled(5))
    recreating = [w for w in operator.proxy.writes_in(namespace, since=mark) if w.kind in WRITTEN_CHILD_KINDS]
    assert recreating == [], recreating
    assert children(kube_cluster, namespace, "tiny") == []
    assert kube_cluster.get("-n", namespace, "rolescalers", "-l", "disagg.dev/model=tiny")["items"] == []


def test_an_idle_operator_makes_no_api_writes(kube_cluster, operator, namespace):
    kube_cluster.kubectl("-n", namespace, "apply", "-f", "examples/dm-cpu-tcp.yaml")
    wait_ready(kube_cluster, namespace, "tiny")
    # Earlier tests' namespaces are being torn down: that is work, not idling.
    wait_until(
        lambda: not [n for n in kube_cluster.get("namespaces")["items"] if n["status"].get("phase") == "Terminating"],
        120,
        interval=POLL_S,
        what="namespaces deleted",
    )
    # Idle starts once the operator has handled every event so far: none reached it and it wrote nothing for
    # 3 s (scaled), a spell shorter than a tick, so a write on every tick still lands in the window below.
    wait_until(quiet(operator.proxy, 3), 3 * TICK_S, what="the operator quiet")
    # Then nothing happens but the operator's clock: each tick recomputes the status of every CR, and must not
    # write what did not change. The window holds six ticks (scaled: on a loaded machine a tick comes late).
    window = scaled(6 * TICK_S)
    before = operator.proxy.snapshot()
    time.sleep(window)
    after = operator.proxy.snapshot()
    writes = {k: after[k] - before[k] for k in after if k[0] != "GET" and after[k] != before[k]}
    print(f"writes while idle for {window:g} s: {sum(writes.values())} {writes}")
    assert writes == {}, operator.log_tail()


def test_a_missing_auth_secret_is_reported_as_degraded(kube_cluster, operator, namespace):
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["auth"] = {"secretName": "not-there"}
    apply_cr(kube_cluster, namespace, cr)
    degraded = wait_until(
        lambda: (lambda c: c if c.get("status") == "True" else None)(
            condition(kube_cluster, namespace, "tiny", "Degraded")
        ),
        60,
        interval=POLL_S,
        what="Degraded=True",
    )
    assert degraded["reason"] == "ReconcileFailed" and "auth Secret not-there not found" in degraded["message"]
    kube_cluster.kubectl("-n", namespace, "create", "secret", "generic", "not-there", "--from-literal=token=t")
    wait_ready(kube_cluster, namespace, "tiny", timeout=120)


def test_an_object_with_a_childs_name_that_the_model_did_not_create_is_left_alone(kube_cluster, operator, namespace):
    """A Service someone made under the router's name: never applied over (nor owned, so never garbage-collected
    with the model); Degraded names it; once its owner deletes it, the model's own takes its place."""
    kube_cluster.kubectl("-n", namespace, "create", "service", "clusterip", "tiny-router", "--tcp=80:8080")
    before = kube_cluster.get("-n", namespace, "service", "tiny-router")
    apply_cr(kube_cluster, namespace, load_example("dm-cpu-tcp.yaml"))
    degraded = wait_until(
        lambda: (lambda c: c if c.get("status") == "True" and "tiny-router" in c.get("message", "") else None)(
            condition(kube_cluster, namespace, "tiny", "Degraded")
        ),
        60,
        interval=POLL_S,
        what="Degraded=True naming the Service",
    )
    assert "Service tiny-router already exists and was not created by this model" in degraded["message"]
    after = kube_cluster.get("-n", namespace, "service", "tiny-router")
    assert after["metadata"].get("ownerReferences") is None
    assert (after["spec"]["ports"], after["metadata"]["labels"]) == (
        before["spec"]["ports"],
        before["metadata"]["labels"],
    )
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    kube_cluster.kubectl("-n", namespace, "delete", "service", "tiny-router")
    wait_ready(kube_cluster, namespace, "tiny", timeout=120)
    owners = kube_cluster.get("-n", namespace, "service", "tiny-router")["metadata"]["ownerReferences"]
    assert [o["kind"] for o in owners] == [names.KIND]


def test_a_pod_labelled_as_the_router_that_its_deployment_did_not_create_is_refused(kube_cluster, operator, namespace):
    """Two forged router pods (the router's own pod template, so its labels: one with no owner, one claiming the
    router Deployment itself as its controller) are named in a Warning Event and never probed; the real router
    pods, which the Deployment's ReplicaSet created, are not named. (The forged pods' /health cannot be served
    here: kwok's pod IPs lead nowhere, so the probe-target selection itself is unit-tested in
    tests/unit/test_operator_router_trust.py.)"""
    apply_cr(kube_cluster, namespace, load_example("dm-cpu-tcp.yaml"))
    wait_ready(kube_cluster, namespace, "tiny")
    deployment = kube_cluster.get("-n", namespace, "deployment", "tiny-router")
    owner = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tiny-router", "controller": True}
    for name, refs in (("forged-a", []), ("forged-b", [{**owner, "uid": deployment["metadata"]["uid"]}])):
        template = deployment["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": template["metadata"]["labels"], "ownerReferences": refs},
            "spec": template["spec"],
        }
        kube_cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(pod))

    def refused() -> str | None:
        said = [e["message"] for e in events_for(kube_cluster, namespace, "tiny") if e["reason"] == "RouterPodRefused"]
        return next((m for m in said if "forged-a" in m and "forged-b" in m), None)

    message = wait_until(refused, 60, interval=POLL_S, what="a RouterPodRefused Event naming both forged pods")
    assert message.endswith("not probed: forged-a, forged-b"), message
    # What the operator's indexes hold (the objects it watches: labelled as its own) admits the real pods.
    managed = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY},{names.MODEL_LABEL}=tiny"
    pods = [observe_pod(p) for p in kube_cluster.get("-n", namespace, "pods", "-l", managed)["items"]]
    objs = kube_cluster.get("-n", namespace, "deployments,replicasets", "-l", managed)["items"]
    uid = kube_cluster.get("-n", namespace, "dm", "tiny")["metadata"]["uid"]
    targets = router_targets(uid, "tiny", pods, [observe_link(o) for o in objs])
    real = [p.name for p in pods if p.role == names.ROUTER and p.name.startswith("tiny-router-")]
    assert real and sorted(targets.probe) == sorted(real) and targets.refused == ("forged-a", "forged-b")
    said = [e["message"] for e in events_for(kube_cluster, namespace, "tiny") if e["reason"] == "RouterPodRefused"]
    assert [p for p in real if any(p in m for m in said)] == []


def test_policies_and_secret_files_are_what_the_api_server_keeps(kube_cluster, operator, namespace):
    """The per-role NetworkPolicies and the Secret volumes pass the API server's validation unchanged, and no
    pod gets a secret through its environment."""
    kube_cluster.kubectl("-n", namespace, "create", "secret", "generic", "client-keys", "--from-literal=api-key=k1")
    cr = load_example("dm-cpu-tcp.yaml")
    cr["spec"]["apiKeySecret"] = {"name": "client-keys"}
    apply_cr(kube_cluster, namespace, cr)
    wait_ready(kube_cluster, namespace, "tiny")
    policies = {p["metadata"]["name"]: p["spec"] for p in kube_cluster.get("-n", namespace, "networkpolicies")["items"]}
    assert set(policies) == {"tiny-prefill", "tiny-decode", "tiny-router"}

    def pods(role: str) -> list[dict]:
        return [{"podSelector": {"matchLabels": {"disagg.dev/model": "tiny", "disagg.dev/role": role}}}]

    prefill = {
        (r["ports"][0]["port"], r["ports"][0].get("endPort")): r["from"] for r in policies["tiny-prefill"]["ingress"]
    }
    assert prefill == {
        (8000, None): pods("router"),
        (8998, None): pods("decode"),
        (9000, None): pods("decode"),
        (15000, 15007): pods("decode"),
    }
    assert policies["tiny-router"]["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]
    for kind, name in [("sts", "tiny-prefill"), ("sts", "tiny-decode"), ("deploy", "tiny-router")]:
        pod = kube_cluster.get("-n", namespace, kind, name)["spec"]["template"]["spec"]
        env = pod["containers"][0].get("env", [])
        assert not [e for e in env if "secretKeyRef" in e.get("valueFrom", {})], name
        volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in pod["volumes"]}
        assert volumes["auth"] == "tiny-auth"
        assert volumes.get("api-keys") == ("client-keys" if kind == "deploy" else None)


def test_chart_can_watch_one_namespace_with_peering(kube_cluster):
    import yaml
    from test_operator_support import CHART

    out = kube_cluster.helm(
        "template", "x", str(CHART), "-n", "sys", "--set", "watchNamespace=llm", "--set", "replicas=2"
    ).stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    assert docs[("Role", "x-disagg-operator")]["metadata"]["namespace"] == "llm"
    assert ("ClusterRole", "x-disagg-operator") not in docs
    assert docs[("KopfPeering", "x-disagg-operator")]["metadata"]["namespace"] == "llm"
    args = docs[("Deployment", "x-disagg-operator")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--peering=x-disagg-operator" in args
    rejected = kube_cluster.helm("template", "x", str(CHART), "--set", "replicas=-1", check=False)
    assert rejected.returncode != 0 and "replicas" in rejected.stderr
