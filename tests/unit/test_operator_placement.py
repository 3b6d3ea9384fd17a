"""What a cluster admin checks in the operator's children: disruption budgets, default resources, spreading, and
bounded local storage (the defects kube-score and kube-linter report, fixed in the builders)."""

from pathlib import Path

import pytest
import yaml

from disagg_operator import names
from disagg_operator.builders import build_children
from disagg_operator.config import OperatorConfig
from disagg_operator.spec import ModelSpec
from disagg_operator.status import transitions
from disagg_operator.weights import cache_condition, estimated_bytes

REPO = Path(__file__).resolve().parents[2]
HOST = "kubernetes.io/hostname"


def load(path: Path) -> dict:
    cr = yaml.safe_load(path.read_text())
    cr["metadata"].update(namespace="ns1", uid="uid-1")
    return cr


@pytest.fixture
def gpu() -> dict:
    """prefill 2 x TP2 with GPUs, decode 2 x TP2, router 2; weights downloaded from Hugging Face."""
    return load(REPO / "hack" / "manifests" / "crs" / "gpu.yaml")


@pytest.fixture
def tiny() -> dict:
    return load(REPO / "examples" / "dm-cpu-tcp.yaml")


def children(cr: dict) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(ModelSpec.from_cr(cr), OperatorConfig())}


def pod(cr: dict, role: str) -> dict:
    kind = "Deployment" if role == names.ROUTER else "StatefulSet"
    return children(cr)[(kind, f"{cr['metadata']['name']}-{role}")]["spec"]["template"]["spec"]


def test_a_drain_never_waits_on_a_pod_that_is_not_ready(gpu):
    pdbs = [c for c in children(gpu).values() if c["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 3
    for pdb in pdbs:
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_router_is_never_best_effort(tiny):
    resources = pod(tiny, names.ROUTER)["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": "250m", "memory": "256Mi", "ephemeral-storage": "1280Mi"}
    assert resources["limits"] == {"memory": "1Gi", "ephemeral-storage": "1280Mi"}


def test_the_crs_router_resources_win_key_by_key(tiny):
    tiny["spec"]["router"]["resources"] = {"requests": {"cpu": "2", "memory": "2Gi"}}
    resources = pod(tiny, names.ROUTER)["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "2" and resources["requests"]["memory"] == "2Gi"
    assert resources["limits"]["memory"] == "2Gi", "a memory limit follows the memory request"
    tiny["spec"]["router"]["resources"] = {"limits": {"memory": "128Mi"}}
    resources = pod(tiny, names.ROUTER)["containers"][0]["resources"]
    assert resources["requests"]["memory"] == "128Mi", "a request never exceeds the CR's limit"


@pytest.mark.parametrize("role", names.ROLES)
def test_replicas_prefer_distinct_nodes_without_a_hard_rule(gpu, role):
    spec = pod(gpu, role)
    [spread] = spec["topologySpreadConstraints"]
    selector = {"matchLabels": {names.MODEL_LABEL: "gpu", names.ROLE_LABEL: role}}
    assert spread == {
        "maxSkew": 1,
        "topologyKey": HOST,
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": selector,
    }
    anti = spec["affinity"]["podAntiAffinity"]
    assert list(anti) == ["preferredDuringSchedulingIgnoredDuringExecution"], "soft: a GPU is never left idle"
    [term] = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"labelSelector": selector, "topologyKey": HOST}


def test_the_crs_spread_and_anti_affinity_replace_the_defaults(gpu):
    zone = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    gpu["spec"]["router"]["topologySpreadConstraints"] = [zone]
    gpu["spec"]["decode"]["topologySpreadConstraints"] = []
    own = {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": HOST, "labelSelector": {}}]}
    gpu["spec"]["router"]["affinity"] = {"podAntiAffinity": own, "nodeAffinity": {"x": 1}}
    router = pod(gpu, names.ROUTER)
    selector = {"matchLabels": {names.MODEL_LABEL: "gpu", names.ROLE_LABEL: "router"}}
    assert router["topologySpreadConstraints"] == [{**zone, "labelSelector": selector}]
    assert router["affinity"] == {"podAntiAffinity": own, "nodeAffinity": {"x": 1}}
    assert "topologySpreadConstraints" not in pod(gpu, names.DECODE)


def test_a_downloaded_model_has_a_bounded_cache_the_scheduler_counts(gpu):
    for role in names.WORKER_ROLES:
        spec = pod(gpu, role)
        vols = {v["name"]: v for v in spec["volumes"]}
        # Llama-3.1-8B: 8e9 parameters x 2 bytes x 1.25 = 20 GB -> 19Gi, rounded up to whole Gi.
        assert vols["hf-cache"]["emptyDir"] == {"sizeLimit": "19Gi"}
        assert vols["tmp"]["emptyDir"] == {"sizeLimit": "4Gi"}
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
        resources = spec["containers"][0]["resources"]
        assert resources["requests"]["ephemeral-storage"] == resources["limits"]["ephemeral-storage"] == "24Gi"
    assert cache_condition(ModelSpec.from_cr(gpu))[:2] == ("False", "Bounded")


def test_a_request_or_limit_of_ephemeral_storage_given_alone_is_followed_by_the_other(gpu):
    gpu["spec"]["decode"].setdefault("resources", {}).setdefault("requests", {})["ephemeral-storage"] = "500Gi"
    res = pod(gpu, names.DECODE)["containers"][0]["resources"]
    assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"] == "500Gi"
    gpu["spec"]["prefill"].setdefault("resources", {}).setdefault("limits", {})["ephemeral-storage"] = "50Gi"
    res = pod(gpu, names.PREFILL)["containers"][0]["resources"]
    assert res["requests"]["ephemeral-storage"] == res["limits"]["ephemeral-storage"] == "50Gi"


def test_cache_size_from_the_cr_and_its_warning_when_too_small_or_unknown(gpu):
    gpu["spec"]["model"]["cacheSize"] = "40Gi"
    assert {v["name"]: v for v in pod(gpu, names.PREFILL)["volumes"]}["hf-cache"]["emptyDir"]["sizeLimit"] == "40Gi"
    gpu["spec"]["model"]["cacheSize"] = "5Gi"
    status, reason, message = cache_condition(ModelSpec.from_cr(gpu))
    assert (status, reason) == ("True", "CacheTooSmall") and "evicted" in message
    gpu["spec"]["model"] = {"huggingFaceId": "acme/house-model"}
    status, reason, message = cache_condition(ModelSpec.from_cr(gpu))
    assert (status, reason) == ("True", "SizeUnknown") and "model.cacheSize" in message
    # No guessed bound (it would evict the pod in the middle of every download): unbounded, and the warning says so.
    decode = pod(gpu, names.DECODE)
    assert {v["name"]: v for v in decode["volumes"]}["hf-cache"]["emptyDir"] == {}
    assert "unbounded" in message
    storage = decode["containers"][0]["resources"]
    assert storage["requests"]["ephemeral-storage"] == storage["limits"]["ephemeral-storage"] == "5Gi"  # /tmp, logs
    gpu["spec"]["model"]["cachePvc"] = "hf"
    assert cache_condition(ModelSpec.from_cr(gpu))[:2] == ("False", "PersistentVolume")


def test_the_cache_warning_is_a_warning_event_when_it_appears():
    at_risk = {"type": names.WEIGHTS_CACHE_AT_RISK, "status": "True", "reason": "SizeUnknown", "message": "m"}
    [event] = transitions([], [at_risk])
    assert (event.type, event.reason) == ("Warning", "SizeUnknown")
    assert transitions([], [{**at_risk, "status": "False", "reason": "Bounded"}]) == []


@pytest.mark.parametrize(
    "model_id,size",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", 0.5e9),
        ("meta-llama/Llama-3.1-70B-Instruct", 70e9),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", 135e6),
        ("mistralai/Mixtral-8x7B-v0.1", 56e9),
        ("openai-community/gpt2", None),
    ],
)
def test_weights_size_is_estimated_from_the_parameter_count_the_id_names(model_id, size):
    assert estimated_bytes(model_id) == (None if size is None else int(size * 2 * 1.25))
