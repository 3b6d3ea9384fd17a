"""`spec.lora`: the same adapters on both roles' command lines (read back by the worker's own parser and LoRA
config), mounted read-only from their ConfigMap, PVC or node directory; the pairing revision follows them; the
model is Ready only once the routers see a healthy prefill and decode serving every declared adapter."""

import argparse
import copy
from pathlib import Path

import pytest
import yaml

from disagg_operator import crd
from disagg_operator.builders import build_worker_statefulset, template_hash, worker_pod_template
from disagg_operator.builders.workers import pairing_revision, worker_args
from disagg_operator.config import OperatorConfig
from disagg_operator.crd_lora import LORA_RULES
from disagg_operator.routerview import merge_reports, missing_adapters
from disagg_operator.spec import ModelSpec
from disagg_operator.status import Findings, RoleObservation, compute_status
from disagg_worker.cli_args import add_engine_args
from disagg_worker.lora_config import LoraConfig

REPO = Path(__file__).resolve().parents[2]
CFG = OperatorConfig()
ADAPTERS = [
    {"name": "sql", "configMap": "sql-adapter"},
    {"name": "chat", "pvc": "adapters", "path": "/chat/v2"},
    {"name": "legal", "pvc": "adapters"},
    {"name": "med", "hostPath": "/srv/adapters/med"},
]


@pytest.fixture
def tiny() -> dict:
    cr = yaml.safe_load((REPO / "examples" / "dm-cpu-tcp.yaml").read_text())
    cr["metadata"].update(namespace="ns1", uid="uid-1", generation=1)
    return cr


def with_lora(cr: dict, **block) -> dict:
    cr = copy.deepcopy(cr)
    cr["spec"]["lora"] = {"adapters": ADAPTERS, **block}
    return cr


def worker_lora(args: list[str]) -> LoraConfig:
    """The LoRA settings a worker reads from the arguments the operator gives it."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns, _ = parser.parse_known_args(args[1:])
    return LoraConfig(tuple(ns.lora_modules), ns.max_loras, ns.max_lora_rank)


def pod(cr: dict, role: str) -> dict:
    return build_worker_statefulset(ModelSpec.from_cr(cr), role, CFG)["spec"]["template"]["spec"]


def test_both_roles_get_every_adapter_at_its_mount_and_the_slots(tiny):
    spec = ModelSpec.from_cr(with_lora(tiny, maxLoras=2, maxLoraRank=32))
    for role in ("prefill", "decode"):
        lora = worker_lora(worker_args(spec, role, CFG))
        mounts = [("sql", "/lora/sql"), ("chat", "/lora/chat"), ("legal", "/lora/legal"), ("med", "/lora/med")]
        assert lora.adapters == mounts
        assert (lora.max_loras, lora.max_lora_rank) == (2, 32)


def test_each_adapter_is_mounted_read_only_from_its_source(tiny):
    for role in ("prefill", "decode"):
        spec = pod(with_lora(tiny), role)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        mounts = {path: m for path, m in mounts.items() if path.startswith("/lora/")}
        assert set(mounts) == {"/lora/sql", "/lora/chat", "/lora/legal", "/lora/med"}
        assert all(m["readOnly"] for m in mounts.values())
        assert volumes[mounts["/lora/sql"]["name"]]["configMap"] == {"name": "sql-adapter"}
        # One PVC, one volume: two directories of it, by subPath (its root for `legal`).
        assert mounts["/lora/chat"]["name"] == mounts["/lora/legal"]["name"]
        claim = volumes[mounts["/lora/chat"]["name"]]["persistentVolumeClaim"]
        assert claim == {"claimName": "adapters", "readOnly": True}
        assert mounts["/lora/chat"]["subPath"] == "chat/v2" and "subPath" not in mounts["/lora/legal"]
        assert volumes[mounts["/lora/med"]["name"]]["hostPath"] == {"path": "/srv/adapters/med", "type": "Directory"}
        assert len([v for v in spec["volumes"] if v["name"].startswith("lora-")]) == 3


def test_a_model_without_the_block_runs_the_pods_it_always_ran(tiny):
    for role in ("prefill", "decode"):
        assert not any(a.startswith("--lora") or "lora" in a for a in worker_args(ModelSpec.from_cr(tiny), role, CFG))
        assert pod(with_lora(tiny), role) != pod(tiny, role)
        assert not any(v["name"].startswith("lora-") for v in pod(tiny, role)["volumes"])
    empty = copy.deepcopy(tiny)
    empty["spec"]["lora"] = {"adapters": []}
    assert pod(empty, "decode") == pod(tiny, "decode")


def test_the_pairing_revision_follows_the_adapters_and_their_files(tiny):
    base = pairing_revision(ModelSpec.from_cr(tiny))
    with_adapters = pairing_revision(ModelSpec.from_cr(with_lora(tiny)))
    moved = copy.deepcopy(with_lora(tiny))
    moved["spec"]["lora"]["adapters"][1]["path"] = "/chat/v3"
    assert len({base, with_adapters, pairing_revision(ModelSpec.from_cr(moved))}) == 3
    # The slots are each pod's own business: they do not split prefill from decode.
    assert pairing_revision(ModelSpec.from_cr(with_lora(tiny, maxLoras=4))) == with_adapters


def test_the_schema_defaults_the_slots_and_bounds_the_names():
    lora = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    lora = lora["lora"]
    assert lora["properties"]["maxLoras"]["default"] == 1 and lora["properties"]["maxLoraRank"]["default"] == 16
    assert lora["required"] == ["adapters"] and lora["properties"]["adapters"]["maxItems"] == 64
    assert {m for _, _, m in LORA_RULES} <= {m for _, _, m in crd.RULES}


SPEC_CR = {
    "metadata": {"name": "m", "namespace": "ns", "uid": "u1", "generation": 3},
    "spec": {
        "model": {"hostPath": "/m", "path": "x"},
        "image": "img",
        "lora": {"adapters": [{"name": "sql", "configMap": "a"}, {"name": "chat", "configMap": "b"}]},
    },
}


def router_report(*workers: tuple[str, str, bool, list[str]]) -> dict:
    listed = [{"url": u, "role": r, "healthy": h, "lora_adapters": a} for u, r, h, a in workers]
    return {"status": "ok", "workers": listed, "pairs": [{"prefill": "p", "decode": "d", "verified": True}]}


def ready(view) -> dict:
    spec = ModelSpec.from_cr(SPEC_CR)
    observed = {r: RoleObservation(1, 1, 1) for r in ("prefill", "decode", "router")}
    for r in ("prefill", "decode"):
        observed[r] = RoleObservation(1, 1, 1, template_hash=template_hash(worker_pod_template(spec, r, CFG)))
    status = compute_status(spec, 3, observed, [], [], {}, "http://e", "T1", Findings(router=view))
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def test_ready_waits_for_a_healthy_prefill_and_decode_serving_every_adapter():
    decode_lacks = router_report(("p", "prefill", True, ["sql", "chat"]), ("d", "decode", True, ["sql"]))
    c = ready(merge_reports({"router-0": decode_lacks}))
    assert (c["status"], c["reason"]) == ("False", "AdaptersNotServed")
    assert "LoRA adapter chat" in c["message"] and "sql" not in c["message"]

    unhealthy = router_report(("p", "prefill", True, ["sql", "chat"]), ("d", "decode", False, ["sql", "chat"]))
    assert ready(merge_reports({"router-0": unhealthy}))["reason"] == "AdaptersNotServed"

    both = router_report(("p", "prefill", True, ["sql", "chat"]), ("d", "decode", True, ["chat", "sql"]))
    assert ready(merge_reports({"router-0": both}))["status"] == "True"
    # Every router must see them: one that lists its workers without a holder of `sql` holds Ready back.
    other = router_report(("p", "prefill", True, ["chat"]), ("d", "decode", True, ["chat", "sql"]))
    assert ready(merge_reports({"router-0": both, "router-1": other}))["reason"] == "AdaptersNotServed"


def test_without_the_routers_workers_ready_follows_the_pods():
    # A router that shows the operator no details (no probe token), or no router answering: the pods' readiness
    # says it, since a worker that cannot load an adapter fails its start-up.
    hidden = {"status": "ok", "pairs": [{"prefill": "p", "decode": "d", "verified": True}]}
    view = merge_reports({"router-0": hidden})
    assert view.adapters is None and missing_adapters(ModelSpec.from_cr(SPEC_CR), view) == ()
    assert ready(view)["status"] == "True"
    assert ready(None)["status"] == "True"


def test_a_malformed_worker_list_reads_as_serving_nothing():
    junk = {"status": "ok", "workers": [1, {"role": "decode", "healthy": "yes", "lora_adapters": "sql"}], "pairs": []}
    assert merge_reports({"router-0": junk}).adapters == frozenset()
