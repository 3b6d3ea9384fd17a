"""The DisaggregatedModel CRD: generated from code, shipped twice (crds/ and the chart), structurally sound."""

import json
from pathlib import Path

import pytest
import yaml

from disagg_operator import crd

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "disagg.dev_disaggregatedmodels.yaml"
CHART = REPO / "charts" / "disagg-operator"


def schema() -> dict:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_committed_crd_is_the_generated_one():
    assert CRD_FILE.read_text() == crd.render(), "run: python -m disagg_operator.crd > " + str(CRD_FILE)


def test_chart_ships_an_identical_copy():
    assert (CHART / "crds" / CRD_FILE.name).read_bytes() == CRD_FILE.read_bytes()


def test_names_short_name_and_scope():
    spec = yaml.safe_load(CRD_FILE.read_text())["spec"]
    assert spec["group"] == "disagg.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "DisaggregatedModel" and spec["names"]["shortNames"] == ["dm"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_status_and_scale_subresources_drive_decode():
    sub = crd.build_crd()["spec"]["versions"][0]["subresources"]
    assert sub["status"] == {}
    assert sub["scale"] == {
        "specReplicasPath": ".spec.decode.replicas",
        "statusReplicasPath": ".status.decode.replicas",
        "labelSelectorPath": ".status.decode.selector",
    }


def test_printer_columns():
    cols = crd.build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in cols] == ["Ready", "P-READY", "D-READY", "Router", "Endpoint", "Age"]
    assert cols[0]["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'


def _walk(node: dict, path: str = ""):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural_every_node_has_a_type():
    for path, node in _walk(schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_nested_blocks_default_to_empty_so_their_defaults_apply():
    spec = schema()["properties"]["spec"]["properties"]
    for block in ("engine", "transfer", "prefill", "decode", "router", "auth"):
        assert spec[block]["default"] == {}, block
    assert spec["engine"]["properties"]["pageSize"]["default"] == 16
    assert spec["transfer"]["properties"]["backend"]["default"] == "mooncake"
    assert spec["prefill"]["properties"]["engine"]["default"] == {}


def test_every_rule_has_a_message_and_sits_where_it_can_see_its_fields():
    at = {path.removeprefix("."): node for path, node in _walk(schema())}
    for where, rule, message in crd.RULES:
        assert {"rule": rule, "message": message} in at[where]["x-kubernetes-validations"]
        assert len(message) > 20
    assert len(crd.RULES) == sum(len(n.get("x-kubernetes-validations", [])) for _, n in _walk(schema()))


@pytest.mark.parametrize(
    "field,needle",
    [
        ("replicas", "replicas >= 0"),
        ("ppSize", "decode.ppSize == self.prefill.ppSize"),
        ("tpSize", "(self.prefill.tpSize / self.prefill.dpSize) % (self.decode.tpSize / self.decode.dpSize)"),
        ("dpSize", "dpSize == 1 || "),
        ("epSize", "epSize == 1 || "),
        ("speculative windows", "ngramMinMatchWindowSize <= "),
        ("speculative draft path", "has(self.draftModelPath)"),
        ("speculative draft volume", "has(self.speculative.draftModelPath)"),
        ("speculative draft ranks", "self.speculative.algorithm == 'NGRAM' || (self.prefill.tpSize"),
        ("pageSize", "pageSize"),
        ("kvDtype", "kvDtype"),
        ("immutable", "oldSelf"),
        ("prefill ranks in whole nodes", "self.prefill.tpSize * self.prefill.ppSize % self.prefill.gpusPerNode == 0"),
        ("decode ranks in whole nodes", "self.decode.tpSize * self.decode.ppSize % self.decode.gpusPerNode == 0"),
        ("prefill nodes", "self.prefill.tpSize * self.prefill.ppSize <= self.prefill.gpusPerNode * 8"),
        ("decode nodes", "self.decode.tpSize * self.decode.ppSize <= self.decode.gpusPerNode * 8"),
    ],
)
def test_the_documented_checks_exist(field, needle):
    assert any(needle in rule for _, rule, _ in crd.RULES), field


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_node_rules_name_the_role_and_why(role):
    ranks = f"self.{role}.tpSize * self.{role}.ppSize"
    [whole] = [m for _, r, m in crd.RULES if r.endswith(f"{ranks} % self.{role}.gpusPerNode == 0")]
    assert whole.startswith(f"{role}.tpSize * {role}.ppSize above {role}.gpusPerNode must be a multiple of it")
    [switch] = [m for _, r, m in crd.RULES if "oldSelf" in r and f"self.{role}.gpusPerNode" in r]
    assert "LeaderWorkerSet" in switch and "delete the model" in switch


def _unknown_fields(obj, node, path=""):
    if isinstance(obj, dict) and node.get("type") == "object" and "properties" in node:
        for k, v in obj.items():
            if k not in node["properties"]:
                yield f"{path}.{k}"
            else:
                yield from _unknown_fields(v, node["properties"][k], f"{path}.{k}")
    elif isinstance(obj, list) and isinstance(node.get("items"), dict):
        for i, v in enumerate(obj):
            yield from _unknown_fields(v, node["items"], f"{path}[{i}]")


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("dm-*.yaml")))
def test_examples_use_only_fields_the_schema_knows(example):
    cr = yaml.safe_load((REPO / "examples" / example).read_text())
    assert list(_unknown_fields(cr["spec"], schema()["properties"]["spec"])) == []


def test_chart_values_follow_the_chart_schema():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    vschema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values) <= set(vschema["properties"])
    for key, node in vschema["properties"].items():
        if node.get("additionalProperties") is False:
            assert set(values.get(key, {})) <= set(node["properties"]), key


def test_every_shipped_crd_is_generated_and_the_chart_has_identical_copies():
    from disagg_operator import scaler_crd

    files = crd.files()
    assert set(files) == {"disagg.dev_disaggregatedmodels.yaml", "disagg.dev_rolescalers.yaml"}
    for name, text in files.items():
        assert (REPO / "crds" / name).read_text() == text, f"run: python -m disagg_operator.crd crds {CHART}/crds"
        assert (CHART / "crds" / name).read_text() == text
    sub = scaler_crd.build_scaler_crd()["spec"]["versions"][0]["subresources"]
    assert sub["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }


def test_day_two_blocks_default_so_their_defaults_apply():
    spec = schema()["properties"]["spec"]
    props = spec["properties"]
    assert "servedModelName" not in spec["required"]
    for block in ("drain", "rollout", "scaling"):
        assert props[block]["default"] == {}, block
    assert props["drain"]["properties"]["timeoutSeconds"]["default"] == 30
    rollout = props["rollout"]["properties"]
    assert rollout["order"]["default"] == "DecodeFirst" and rollout["order"]["enum"] == ["DecodeFirst", "PrefillFirst"]
    assert rollout["progressDeadlineSeconds"]["default"] == 600 and "default" not in rollout["maxSkew"]
    assert props["scaling"]["properties"]["prefillPerDecode"]["exclusiveMinimum"] is True


def test_served_model_name_stays_immutable_when_it_defaults_to_the_name():
    rule = next(r for w, r, _ in crd.RULES if "servedModelName" in r)
    assert "oldSelf.metadata.name" in rule and "self.metadata.name" in rule
