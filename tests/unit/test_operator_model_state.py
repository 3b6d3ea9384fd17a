"""What the operator keeps for each model (model_state.py): a deleted model leaves none of it behind, a model
created again under the same name starts afresh, and no model's state reaches another model's status."""

import copy
from typing import Any

import pytest

from disagg_operator.apply_errors import ReconcileError
from disagg_operator.builders import template_hash, worker_pod_template
from disagg_operator.config import OperatorConfig
from disagg_operator.observe import PodInfo, PodProblem, RoleObservation
from disagg_operator.reconcile import Runtime
from disagg_operator.routerview import merge_reports
from disagg_operator.spec import ModelSpec
from tests.unit.test_operator_status import CR, FakeKube, conds


class StatusByName(FakeKube):
    """A FakeKube that keeps each model's latest status, by the model's name."""

    def __init__(self):
        super().__init__()
        self.statuses: dict[str, dict] = {}

    def patch_status(self, namespace, name, status, kind="DisaggregatedModel"):
        super().patch_status(namespace, name, status, kind)
        if kind == "DisaggregatedModel":
            self.statuses[name] = status


def model(name: str, uid: str) -> dict[str, Any]:
    cr = copy.deepcopy(CR)
    cr["metadata"].update(name=name, uid=uid)
    return cr


def replacing(cr: dict[str, Any]) -> dict[str, RoleObservation]:
    """Every role on the template the operator applies for `cr`, one decode pod not (yet) ready."""
    spec = ModelSpec.from_cr(cr)
    applied = {r: template_hash(worker_pod_template(spec, r, OperatorConfig())) for r in ("prefill", "decode")}
    return {
        "prefill": RoleObservation(1, 1, 1, template_hash=applied["prefill"]),
        "decode": RoleObservation(2, 1, 2, template_hash=applied["decode"]),
        "router": RoleObservation(1, 1, 1),
    }


def routers(cr: dict[str, Any]) -> list[PodInfo]:
    return [PodInfo(f"{cr['metadata']['name']}-router-0", "router", ip="10.0.0.1")]


def failed(cr: dict[str, Any]) -> PodProblem:
    return PodProblem(f"{cr['metadata']['name']}-decode-0", "decode", "container decode: Error (exit code 1)")


def runtime() -> tuple[Runtime, StatusByName]:
    kube = StatusByName()
    return Runtime(kube, OperatorConfig(), lambda cr, e: None), kube


def test_a_deleted_model_leaves_nothing_behind_and_its_namesake_starts_afresh():
    rt, kube = runtime()
    cr, other = model("m", "u1"), model("other", "u2")
    for each in (cr, other):  # every kind of state a model gathers: owned children, partitions, scaler writes...
        rt.apply_children(each, replacing(each), routers(each))
        rt.sync_scaler(each, None, 1)
        rt.refresh_status(each, replacing(each), [failed(each)], routers(each))  # ...inputs, a latched failure
        rt.models[each["metadata"]["uid"]].view = merge_reports({f"{each['metadata']['name']}-router-0": {}})
    assert set(rt.models) == {"u1", "u2"} and set(rt.router_pods()) == {"u1", "u2"}

    rt.forget("u1")
    assert set(rt.models) == {"u2"} and rt.known("u1") is None and set(rt.router_pods()) == {"u2"}
    writes = len(kube.status_writes)
    # Handlers that were still running for the deleted model: they write no status and keep nothing.
    rt.apply_children(cr, replacing(cr), routers(cr))
    rt.sync_scaler(cr, None, 1)
    assert not rt.refresh_status(cr, replacing(cr), [], routers(cr))
    rt.tick("u1")
    assert set(rt.models) == {"u2"} and len(kube.status_writes) == writes

    # The same name again, with a new uid: its children were collected with the old model, and nothing of the
    # old one is carried over: the RoleScaler is created again, the old pod's failure is not reported.
    kube.objects.clear()
    again = model("m", "u3")
    rt.sync_scaler(again, None, 1)
    assert kube.created[-1] == "RoleScaler/m-prefill" and kube.created.count("RoleScaler/m-prefill") == 2
    rt.refresh_status(again, replacing(again), [], routers(again))
    assert conds(kube.statuses["m"])["Degraded"]["status"] == "False"
    rt.refresh_status(other, replacing(other), [], routers(other))  # the other model's failure is still latched
    degraded = conds(kube.statuses["other"])["Degraded"]
    assert degraded["status"] == "True" and "other-decode-0" in degraded["message"]


def test_two_models_states_are_independent():
    rt, kube = runtime()
    a, b = model("a", "ua"), model("b", "ub")
    rt.sync_scaler(a, None, 1)
    rt.sync_scaler(b, None, 1)  # a's RoleScaler write does not stand for b's
    assert kube.created == ["RoleScaler/a-prefill", "RoleScaler/b-prefill"]

    broken = {**a, "spec": {**a["spec"], "auth": {"secretName": "absent"}}}
    with pytest.raises(ReconcileError):
        rt.apply_children(broken)
    rt.apply_children(b)
    rt.refresh_status(broken, replacing(a), [failed(a)], routers(a))
    rt.refresh_status(b, replacing(b), [], routers(b))
    degraded_a, degraded_b = conds(kube.statuses["a"])["Degraded"], conds(kube.statuses["b"])["Degraded"]
    assert degraded_a["status"] == "True" and "auth Secret absent not found" in degraded_a["message"]
    assert degraded_b["status"] == "False"  # neither a's reconcile error nor its failed pod is b's

    unverified = {"pairs": [{"prefill": "a-prefill-0", "decode": "a-decode-0", "verified": False, "error": "x"}]}
    model_a = rt.known("ua")
    assert model_a is not None
    model_a.view = merge_reports({"a-router-0": unverified})  # as the prober records a's routers' reports
    rt.refresh_cached("ua")
    rt.refresh_cached("ub")
    assert conds(kube.statuses["a"])["PairingVerified"]["status"] == "False"
    assert conds(kube.statuses["b"])["PairingVerified"]["status"] != "False"
    assert rt.known("ub") is not rt.known("ua")
