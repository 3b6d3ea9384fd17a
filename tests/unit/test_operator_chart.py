"""The Helm chart's static promises: no RBAC wildcards, standard labels, the operator's flags."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "charts" / "disagg-operator" / "templates"


def test_rbac_grants_no_wildcards():
    text = (TEMPLATES / "rbac.yaml").read_text() + (TEMPLATES / "_helpers.tpl").read_text()
    assert re.findall(r'"\*"|\[\s*\*\s*\]|- \*', text) == []
    assert "verbs:" in text


def test_operator_needs_no_delete_nor_secret_listing():
    rules = (TEMPLATES / "_helpers.tpl").read_text()
    assert '"delete"' not in rules
    secrets = rules.split('resources: ["secrets"]')[1].split("\n")[1]
    assert secrets.strip() == 'verbs: ["get", "create"]'


def test_every_template_carries_the_standard_labels():
    helpers = (TEMPLATES / "_helpers.tpl").read_text()
    for label in (
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
        "app.kubernetes.io/managed-by",
        "app.kubernetes.io/component",
        "app.kubernetes.io/part-of",
    ):
        assert label in helpers
    for path in TEMPLATES.glob("*.yaml"):
        text = path.read_text()
        objects = len(re.findall(r"^metadata:", text, re.M))
        labelled = text.count('include "disagg-operator.labels" . | nindent 4')
        assert objects == labelled, path.name


def test_deployment_passes_scope_and_peering_flags_the_operator_understands():
    from disagg_operator.main import parse_args

    text = (TEMPLATES / "deployment.yaml").read_text()
    for flag in ("--namespace=", "--all-namespaces", "--peering=", "--standalone", "--liveness="):
        assert flag in text
    args = parse_args(["--namespace=ns", "--peering=p", "--liveness=http://0.0.0.0:8080/healthz"])
    assert args.namespace == ["ns"] and args.peering == "p"
