"""`spec.router.flowControl`: the router's `--flow-*` flags from the CR, checked by the router's own parser and the
flow policy it builds from them; a model without the block runs the router it always ran."""

import argparse
import copy
import hashlib
from pathlib import Path

import pytest
import yaml

from disagg_api import router_settings as R
from disagg_operator import crd
from disagg_operator.builders.router import build_router_deployment, router_args
from disagg_operator.config import OperatorConfig
from disagg_operator.crd_flow import FLOW_RULES
from disagg_operator.spec import ModelSpec
from disagg_worker.flow.policy import FlowPolicy
from disagg_worker.http.flow_gate import NO_FLOW_CONTROL, FlowGate
from disagg_worker.router.args import add_router_args
from disagg_worker.router.flow_control import flow_control

REPO = Path(__file__).resolve().parents[2]
CFG = OperatorConfig()
DIGEST = hashlib.sha256(b"team-a-key").hexdigest()[:32]


@pytest.fixture
def tiny() -> dict:
    cr = yaml.safe_load((REPO / "examples" / "dm-cpu-tcp.yaml").read_text())
    cr["metadata"].update(namespace="ns1", uid="uid-1", generation=1)
    return cr


def with_flow(cr: dict, block: dict) -> dict:
    cr = copy.deepcopy(cr)
    cr["spec"]["router"]["flowControl"] = block
    return cr


def router_gate(cr: dict):
    """The flow control the router builds from the arguments the operator gives it."""
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return flow_control(parser.parse_args(router_args(ModelSpec.from_cr(cr), CFG)[1:]))


def flow_schema() -> dict:
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["router"]["properties"]["flowControl"]


def test_the_block_sets_the_routers_queue_objectives_and_key_caps(tiny):
    cr = with_flow(
        tiny,
        {
            "queueSize": 512,
            "queueTTLSeconds": 20,
            "minPriority": -5,
            "maxPriority": 8,
            "objectives": [{"name": "chat", "priority": 5}, {"name": "batch", "priority": -1}],
            "keyPriorities": [{"digest": DIGEST, "priority": 2}],
        },
    )
    gate = router_gate(cr)
    assert isinstance(gate, FlowGate)
    assert gate.policy == FlowPolicy(
        queue_size=512,
        ttl_s=20.0,
        objectives={"chat": 5, "batch": -1},
        min_priority=-5,
        max_priority=8,
        key_max={DIGEST: 2},
    )
    args = router_args(ModelSpec.from_cr(cr), CFG)
    assert args[args.index("--flow-objectives") + 1] == "chat=5,batch=-1"
    assert args[args.index("--flow-key-priority") + 1] == f"{DIGEST}=2"


def test_an_empty_block_turns_flow_control_on_with_the_routers_defaults(tiny):
    gate = router_gate(with_flow(tiny, {}))
    assert isinstance(gate, FlowGate) and gate.policy == FlowPolicy()
    args = router_args(ModelSpec.from_cr(with_flow(tiny, {})), CFG)
    assert "--flow-objectives" not in args and "--flow-key-priority" not in args


def test_the_crd_defaults_are_the_routers_so_a_cr_read_back_runs_the_same_router(tiny):
    props = flow_schema()["properties"]
    assert props["enabled"]["default"] is True
    declared = {
        "queueSize": R.FLOW_QUEUE_SIZE,
        "queueTTLSeconds": R.FLOW_QUEUE_TTL,
        "minPriority": R.FLOW_MIN_PRIORITY,
        "maxPriority": R.FLOW_MAX_PRIORITY,
    }
    for name, setting in declared.items():
        assert props[name]["default"] == setting.default, name
    defaulted = {name: props[name]["default"] for name in ("enabled", *declared)}
    assert router_args(ModelSpec.from_cr(with_flow(tiny, defaulted)), CFG) == router_args(
        ModelSpec.from_cr(with_flow(tiny, {})), CFG
    )


def test_a_model_without_the_block_or_with_it_off_runs_the_same_router(tiny):
    without = ModelSpec.from_cr(tiny)
    off = ModelSpec.from_cr(with_flow(tiny, {"enabled": False, "objectives": [{"name": "chat", "priority": 5}]}))
    assert not any(a.startswith("--flow") for a in router_args(without, CFG))
    assert router_args(off, CFG) == router_args(without, CFG)
    assert build_router_deployment(off, CFG) == build_router_deployment(without, CFG)
    assert router_gate(tiny) is NO_FLOW_CONTROL


def test_the_cr_holds_digests_of_keys_never_keys():
    digest = flow_schema()["properties"]["keyPriorities"]["items"]["properties"]
    assert set(digest) == {"digest", "priority"}
    [(_, rule, message)] = [r for r in FLOW_RULES if "k.digest.matches" in r[1]]
    assert "[0-9a-f]{32}" in rule and "sha256sum | cut -c1-32" in message


@pytest.mark.parametrize(
    "fragment,field",
    [
        ("self.minPriority <= self.maxPriority", "router.flowControl.minPriority"),
        ("self.queueSize >= 1", "router.flowControl.queueSize"),
        ("self.queueTTLSeconds > 0.0", "router.flowControl.queueTTLSeconds"),
        ("self.objectives.exists_one", "router.flowControl.objectives"),
        ("o.name.matches", "router.flowControl.objectives[].name"),
        ("o.priority <= self.maxPriority", "router.flowControl.objectives[].priority"),
        ("self.keyPriorities.exists_one", "router.flowControl.keyPriorities"),
        ("k.priority <= self.maxPriority", "router.flowControl.keyPriorities[].priority"),
        ("has(self.apiKeySecret)", "router.flowControl.keyPriorities"),
    ],
)
def test_each_flow_rule_sits_on_the_block_and_names_its_field(fragment, field):
    [(where, rule, message)] = [r for r in crd.RULES if fragment in r[1]]
    assert message.startswith(field)
    if where == "spec.router.flowControl":
        assert {"rule": rule, "message": message} in flow_schema()["x-kubernetes-validations"]


def doc_cr() -> dict:
    """The DisaggregatedModel docs/flow-control.md shows under "With the operator"."""
    text = (REPO / "docs" / "flow-control.md").read_text().split("## With the operator", 1)[1]
    return yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])


def test_the_documented_model_uses_only_known_fields_and_gives_the_router_what_its_comments_say():
    from tests.unit.test_operator_crd import _unknown_fields

    cr = doc_cr()
    spec_schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert list(_unknown_fields(cr["spec"], spec_schema)) == []
    assert set(spec_schema["required"]) <= set(cr["spec"])
    args = router_args(ModelSpec.from_cr(cr), CFG)
    assert args[args.index("--flow-objectives") + 1] == "chat=5,batch=-1"
    policy = router_gate(cr).policy
    assert (policy.queue_size, policy.ttl_s, policy.min_priority, policy.max_priority) == (512, 20.0, -10, 10)
    assert sorted(policy.key_max.values()) == [-1, 0]
