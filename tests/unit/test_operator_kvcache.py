"""`spec.kvCache`: the workers' KV tier flags, Mooncake Store's Deployment, Service and NetworkPolicy, the workers'
memory, the store's status and what is retired when the store goes; checked without a cluster."""

from pathlib import Path

import pytest
import yaml

from disagg_operator import crd, names
from disagg_operator.builders import build_children, retired_children
from disagg_operator.builders.workers import worker_args
from disagg_operator.config import OperatorConfig
from disagg_operator.observe import PodProblem, RoleObservation
from disagg_operator.spec import ModelSpec
from disagg_operator.status import compute_status, latch_problems, settled_roles

REPO = Path(__file__).resolve().parents[2]
CFG = OperatorConfig()
STORE = {"memory": "4Gi"}
ALL_READY = {r: RoleObservation(1, 1, 1) for r in names.ROLES}


def tiny(kv_cache: dict | None = None) -> dict:
    cr = yaml.safe_load((REPO / "examples" / "dm-cpu-tcp.yaml").read_text())
    cr["metadata"].update(namespace="ns1", uid="uid-1", generation=1, labels={"team": "a"})
    if kv_cache is not None:
        cr["spec"]["kvCache"] = kv_cache
    return cr


def children(cr: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(ModelSpec.from_cr(cr), CFG)}


def flags(args: list[str]) -> dict[str, str | None]:
    """`--flag value` and `--switch` words of a command line, by flag (the last value wins)."""
    out: dict[str, str | None] = {}
    for i, word in enumerate(args):
        if word.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[word] = nxt if nxt is not None and not nxt.startswith("--") else None
    return out


def test_without_kv_cache_no_worker_gains_a_flag_and_no_store_is_made():
    cr = tiny()
    for role in names.WORKER_ROLES:
        assert not [a for a in worker_args(ModelSpec.from_cr(cr), role) if "hicache" in a or "hierarchical" in a]
    assert not [k for k in children(cr) if k[1] == "tiny-kvstore"]


def test_the_host_tier_alone_gives_each_role_its_size_and_no_store():
    spec = ModelSpec.from_cr(tiny({"decode": {"hostSize": "4Gi"}, "writePolicy": "write_back"}))
    prefill, decode = (flags(worker_args(spec, r)) for r in names.WORKER_ROLES)
    assert "--enable-hierarchical-cache" in prefill and "--enable-hierarchical-cache" in decode
    assert prefill["--hicache-ratio"] == "2.0" and "--hicache-size" not in prefill
    assert decode["--hicache-size"] == str(4 * 2**30 / 1e9) and "--hicache-ratio" not in decode
    assert prefill["--hicache-write-policy"] == decode["--hicache-write-policy"] == "write_back"
    assert not [f for f in prefill if "storage" in f or "store" in f]
    assert not [k for k in children(tiny({})) if k[1] == "tiny-kvstore"]


def test_every_worker_is_told_where_the_store_is_and_how_to_prefetch():
    kv = {"store": {**STORE, "prefetchPolicy": "timeout", "prefetchTimeoutSeconds": 0.5}}
    spec = ModelSpec.from_cr(tiny(kv))
    for role in names.WORKER_ROLES:
        f = flags(worker_args(spec, role))
        assert f["--hicache-storage-backend"] == "mooncake"
        assert f["--hicache-store-master"] == "tiny-kvstore.ns1.svc:50051"
        assert f["--hicache-store-metadata-server"] == "http://tiny-kvstore.ns1.svc:8080/metadata"
        assert (f["--hicache-storage-prefetch-policy"], f["--hicache-storage-prefetch-timeout"]) == ("timeout", "0.5")
        assert "--enable-hierarchical-cache" in f


def test_the_store_is_a_deployment_a_service_and_a_network_policy_owned_by_the_model():
    made = children(tiny({"store": STORE}))
    store = {k: v for k, v in made.items() if k[1] == "tiny-kvstore"}
    assert set(store) == {
        ("Deployment", "tiny-kvstore"),
        ("Service", "tiny-kvstore"),
        ("NetworkPolicy", "tiny-kvstore"),
    }
    for obj in store.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        labels = obj["metadata"]["labels"]
        assert labels["team"] == "a" and labels[names.LABEL_COMPONENT] == "kvstore"
        assert labels[names.MODEL_LABEL] == "tiny" and labels[names.ROLE_LABEL] == "kvstore"
    order = [k for k in made if k[0] in ("Service", "Deployment", "StatefulSet")]
    assert order.index(("Deployment", "tiny-kvstore")) < order.index(("StatefulSet", "tiny-prefill"))
    assert order.index(("Service", "tiny-kvstore")) < order.index(("Deployment", "tiny-kvstore"))


def test_the_store_pod_runs_the_master_and_the_stores_memory():
    deployment = children(tiny({"store": {"memory": "4Gi"}}))[("Deployment", "tiny-kvstore")]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"][names.ROLE_LABEL] == "kvstore"
    master, client = pod["spec"]["containers"]
    assert master["command"] == ["mooncake_master"] and client["command"] == ["mooncake_client"]
    assert master["image"] == client["image"] == "ghcr.io/disagg/worker:0.1.0"
    assert {"-rpc_port=50051", "-enable_http_metadata_server=true", "-http_metadata_server_port=8080"} <= set(
        master["args"]
    )
    assert "-http_metadata_server_host=0.0.0.0" in master["args"]
    assert client["args"][:5] == [
        f"-global_segment_size={4 * 2**30}",
        "-master_server_address=127.0.0.1:50051",
        "-metadata_server=http://127.0.0.1:8080/metadata",
        "-host=$(POD_IP)",
        "-protocol=tcp",
    ]
    env = {e["name"]: e.get("value") for e in client["env"]}
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("17100", "17107") and "POD_IP" in env
    # The segment plus 512Mi for the client process; the master 512Mi; both limited at their request.
    assert client["resources"]["requests"]["memory"] == client["resources"]["limits"]["memory"] == "4608Mi"
    assert master["resources"]["requests"]["memory"] == master["resources"]["limits"]["memory"] == "512Mi"
    assert master["readinessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
    assert {p["name"]: p["containerPort"] for p in master["ports"]} == {"rpc": 50051, "metadata": 8080, "admin": 9003}
    assert client["readinessProbe"]["httpGet"]["port"] == "health"
    for c in (master, client):
        assert c["securityContext"]["readOnlyRootFilesystem"] and c["volumeMounts"][0]["mountPath"] == "/tmp"
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_the_service_publishes_the_masters_rpc_and_metadata_ports():
    service = children(tiny({"store": STORE}))[("Service", "tiny-kvstore")]
    assert service["spec"]["selector"] == {names.MODEL_LABEL: "tiny", names.ROLE_LABEL: "kvstore"}
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("rpc", 50051), ("metadata", 8080)]


def test_the_store_admits_only_this_models_workers_on_its_ports():
    policy = children(tiny({"store": STORE}))[("NetworkPolicy", "tiny-kvstore")]["spec"]
    assert policy["podSelector"]["matchLabels"] == {names.MODEL_LABEL: "tiny", names.ROLE_LABEL: "kvstore"}
    workers = [
        {"podSelector": {"matchLabels": {names.MODEL_LABEL: "tiny", names.ROLE_LABEL: r}}} for r in names.WORKER_ROLES
    ]
    ports = []
    for rule in policy["ingress"]:
        assert rule["from"] == workers
        ports += [(p["port"], p.get("endPort")) for p in rule["ports"]]
    assert ports == [(50051, None), (8080, None), (17100, 17107)]


def test_the_workers_memory_grows_by_the_host_tiers_size_where_the_cr_sets_it():
    cr = tiny({"prefill": {"hostSize": "2Gi"}, "decode": {"hostRatio": 4}})
    for role in names.WORKER_ROLES:
        cr["spec"][role]["resources"] = {"requests": {"memory": "2Gi", "cpu": 1}, "limits": {"memory": "4Gi"}}
    made = children(cr)

    def memory(role: str) -> tuple[str, str]:
        res = made[("StatefulSet", f"tiny-{role}")]["spec"]["template"]["spec"]["containers"][0]["resources"]
        return res["requests"]["memory"], res["limits"]["memory"]

    assert memory("prefill") == ("4Gi", "6Gi")
    assert memory("decode") == ("2Gi", "4Gi")  # a ratio's bytes are the model's: the CR's memory must hold them


def test_removing_the_store_retires_its_children_and_keeps_the_host_tier():
    assert retired_children(ModelSpec.from_cr(tiny({"store": STORE}))) == []
    retired = retired_children(ModelSpec.from_cr(tiny({})))
    assert [(r["kind"], r["metadata"]["name"], r["metadata"]["namespace"]) for r in retired] == [
        ("Deployment", "tiny-kvstore", "ns1"),
        ("Service", "tiny-kvstore", "ns1"),
        ("NetworkPolicy", "tiny-kvstore", "ns1"),
    ]
    assert "--enable-hierarchical-cache" in worker_args(ModelSpec.from_cr(tiny({})), names.DECODE)


def test_status_shows_the_stores_readiness_and_ready_does_not_wait_for_it():
    spec = ModelSpec.from_cr(tiny({"store": STORE}))
    status = compute_status(spec, 1, ALL_READY, [], [], {}, "", "2024-01-01T00:00:00Z")
    assert status["kvStore"] == {"readyReplicas": 0, "ready": "0/1", "master": "tiny-kvstore.ns1.svc:50051"}
    observed = {**ALL_READY, names.KVSTORE: RoleObservation(1, 1, 1)}
    status = compute_status(spec, 1, observed, [], [], {}, "", "2024-01-01T00:00:00Z")
    assert status["kvStore"]["ready"] == "1/1"
    no_store = compute_status(ModelSpec.from_cr(tiny({})), 1, ALL_READY, [], [], {}, "", "2024-01-01T00:00:00Z")
    assert no_store["kvStore"] is None  # removed by the status merge patch


def test_a_failing_store_pod_stays_reported_until_a_store_pod_is_ready():
    spec = ModelSpec.from_cr(tiny({"store": STORE}))
    problem = PodProblem("tiny-kvstore-abc", names.KVSTORE, "container store: OOMKilled (exit code 137)")
    latched = latch_problems({}, [problem], settled_roles(spec, {**ALL_READY, names.KVSTORE: RoleObservation(1, 0, 1)}))
    status = compute_status(spec, 1, ALL_READY, list(latched.values()), [], {}, "", "2024-01-01T00:00:00Z")
    degraded = next(c for c in status["conditions"] if c["type"] == names.DEGRADED)
    assert (
        degraded["status"] == "True"
        and "kvstore pod tiny-kvstore-abc: container store: OOMKilled" in degraded["message"]
    )
    latched = latch_problems(latched, [], settled_roles(spec, {**ALL_READY, names.KVSTORE: RoleObservation(1, 0, 1)}))
    assert list(latched) == ["tiny-kvstore-abc"]
    assert (
        latch_problems(latched, [], settled_roles(spec, {**ALL_READY, names.KVSTORE: RoleObservation(1, 1, 1)})) == {}
    )


def kv_schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "kvCache"
    ]


def test_the_schema_takes_a_ratio_or_a_size_per_role_and_the_stores_settings():
    kv = kv_schema()
    assert set(kv["properties"]) == {"prefill", "decode", "writePolicy", "store"}
    assert set(kv["properties"]["decode"]["properties"]) == {"hostRatio", "hostSize"}
    store = kv["properties"]["store"]
    assert store["required"] == ["memory"]
    assert store["properties"]["prefetchPolicy"]["enum"] == ["best_effort", "wait_complete", "timeout"]
    assert kv["properties"]["writePolicy"]["default"] == "write_through"
    assert store["properties"]["prefetchTimeoutSeconds"]["exclusiveMinimum"] is True


@pytest.mark.parametrize(
    "fragment,message",
    [
        ("has(self.prefill.hostRatio) && has(self.prefill.hostSize)", "kvCache.prefill.hostRatio and kvCache.prefill"),
        ("has(self.decode.hostRatio) && has(self.decode.hostSize)", "kvCache.decode.hostRatio and kvCache.decode"),
        ("self.store.memory.matches", "kvCache.store.memory must be above 0"),
    ],
)
def test_each_kv_cache_rule_says_which_field_to_change(fragment, message):
    [(where, _, said)] = [r for r in crd.RULES if fragment in r[1]]
    assert where == "spec.kvCache" and message in said
    assert {"rule": next(r[1] for r in crd.RULES if fragment in r[1]), "message": said} in kv_schema()[
        "x-kubernetes-validations"
    ]


class FakeKube:
    """The API calls a reconcile makes, against an in-memory store of objects by (kind, name)."""

    def __init__(self):
        self.objects: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple[str, str, str]] = []

    def get(self, api_version, kind, namespace, name):
        self.calls.append(("get", kind, name))
        return self.objects.get((kind, name))

    def apply(self, obj):
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        self.objects[(obj["kind"], obj["metadata"]["name"])] = obj

    def create_if_absent(self, obj):
        return self.objects.setdefault((obj["kind"], obj["metadata"]["name"]), obj) is obj

    def delete(self, api_version, kind, namespace, name):
        self.calls.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None


def test_removing_the_store_deletes_its_children_once_and_only_the_models_own():
    from disagg_operator.reconcile import Runtime

    kube = FakeKube()
    runtime = Runtime(kube, CFG, lambda cr, e: None)
    runtime.apply_children(tiny({"store": STORE}), workers=False)
    assert {("Deployment", "tiny-kvstore"), ("Service", "tiny-kvstore"), ("NetworkPolicy", "tiny-kvstore")} <= set(
        kube.objects
    )
    kube.objects[("Service", "tiny-kvstore")]["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    kube.calls.clear()
    runtime.apply_children(tiny({}), workers=False)
    deleted = [(kind, name) for verb, kind, name in kube.calls if verb == "delete"]
    assert deleted == [("Deployment", "tiny-kvstore"), ("NetworkPolicy", "tiny-kvstore")]
    assert ("Service", "tiny-kvstore") in kube.objects  # not the model's: left alone
    kube.calls.clear()
    runtime.apply_children(tiny({}), workers=False)  # known gone: not even read again
    assert not [c for c in kube.calls if c[2] == "tiny-kvstore"]
    del kube.objects[("Service", "tiny-kvstore")]  # its owner deleted it
    runtime.apply_children(tiny({"store": STORE}), workers=False)  # back: applied, and pruned again when it goes
    kube.calls.clear()
    runtime.apply_children(tiny({}), workers=False)
    assert ("delete", "Deployment", "tiny-kvstore") in kube.calls
