"""The Helm chart as a cluster would receive it: `helm template` rendered, parsed, and its objects checked.

No RBAC wildcards and no RBAC kinds, delete only on the kinds of the children a spec change retires (the KV store's
Deployment, Service and NetworkPolicy, when `spec.kvCache.store` goes; the gateway's objects, when `spec.gateway`
does), Secrets only read and created; every object carries the standard labels; the
operator Deployment's flags and settings are ones the operator understands. This tier is where helm is built
(hack/k8s/build.sh), so rendering never needs a skip; no cluster is started.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from disagg_operator.config import OperatorConfig
from disagg_operator.main import parse_args
from tests.observability import DASHBOARD, rules_with_defaults
from tests.timing import scaled

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg-operator"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
RELEASE, RELEASE_NS, FULLNAME = "rel", "ops", "rel-disagg-operator"

VARIANTS = {
    "cluster-wide": [],
    "cluster-wide-ha": ["--set", "replicas=2"],
    "one-namespace": ["--set", "watchNamespace=team-a"],
    "one-namespace-ha": ["--set", "watchNamespace=team-a", "--set", "replicas=2"],
    "dashboards-and-rules": ["--set", "dashboards.enabled=true", "--set", "prometheusRule.enabled=true"],
    "inferencepool-crd": ["--set", "gateway.installInferencePoolCRD=true"],
}

Render = Callable[..., list[dict]]


@pytest.fixture(scope="module")
def render(k8s_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Render:
    home = tmp_path_factory.mktemp("helm")
    env = {**os.environ, **{f"HELM_{d}_HOME": str(home / d.lower()) for d in ("CACHE", "CONFIG", "DATA")}}

    def _render(*values: str) -> list[dict]:
        proc = subprocess.run(
            [str(k8s_bin_dir / "helm"), "template", RELEASE, str(CHART), "--namespace", RELEASE_NS, *values],
            env=env,
            capture_output=True,
            text=True,
            timeout=scaled(60),
        )
        assert proc.returncode == 0, proc.stderr
        return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]

    return _render


def of_kind(objects: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objects if o["kind"] in kinds]


def deployment_container(objects: list[dict]) -> dict:
    [deployment] = of_kind(objects, "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_rbac_grants_no_wildcards_delete_only_on_retired_kinds_and_secrets_only_get_and_create(
    render: Render, values: list[str]
):
    roles = of_kind(render(*values), "ClusterRole", "Role")
    rules = [r for role in roles for r in role["rules"]]
    assert len(roles) == 2 and rules
    deletable = set()
    for r in rules:
        for key in ("apiGroups", "resources", "verbs"):
            assert r[key] and "*" not in r[key], r
        assert not {"deletecollection", "escalate", "bind", "impersonate"} & set(r["verbs"]), r
        if "delete" in r["verbs"]:
            deletable |= {(group, resource) for group in r["apiGroups"] for resource in r["resources"]}
    assert deletable == {
        ("apps", "deployments"),
        ("", "services"),
        ("networking.k8s.io", "networkpolicies"),
        ("policy", "poddisruptionbudgets"),
        ("", "serviceaccounts"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("gateway.networking.k8s.io", "httproutes"),
    }
    secrets = [r for r in rules if "secrets" in r["resources"]]
    assert [(r["resources"], r["verbs"]) for r in secrets] == [(["secrets"], ["get", "create"])]
    # The operator grants nothing: no RBAC object is its to read or write (the picker it makes is bound to no Role).
    assert not [r for r in rules if "rbac.authorization.k8s.io" in r["apiGroups"]]


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_binding_gives_the_charts_roles_to_the_charts_service_account(render: Render, values: list[str]):
    objects = render(*values)
    [account] = of_kind(objects, "ServiceAccount")
    roles = {(o["kind"], o["metadata"]["name"]) for o in of_kind(objects, "ClusterRole", "Role")}
    bindings = of_kind(objects, "ClusterRoleBinding", "RoleBinding")
    assert {(b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bindings} == roles
    for b in bindings:
        assert b["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": RELEASE_NS}]
    assert (account["metadata"]["name"], account["metadata"]["namespace"]) == (FULLNAME, RELEASE_NS)
    [deployment] = of_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == FULLNAME


def test_watching_one_namespace_grants_a_role_there_and_nothing_namespaced_cluster_wide(render: Render):
    objects = render(*VARIANTS["one-namespace"])
    [role] = of_kind(objects, "Role")
    assert role["metadata"]["namespace"] == "team-a"
    cluster_resources = {
        res for r in of_kind(objects, "ClusterRole") for rule in r["rules"] for res in rule["resources"]
    }
    assert cluster_resources == {"customresourcedefinitions"}


@pytest.mark.parametrize("values", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_object_carries_the_standard_labels(render: Render, values: list[str]):
    standard = {
        "app.kubernetes.io/name": "disagg-operator",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/version": APP_VERSION,
        "app.kubernetes.io/component": "operator",
        "app.kubernetes.io/part-of": "disagg",
        "app.kubernetes.io/managed-by": "Helm",
    }
    objects = render(*values)
    assert len(objects) >= 6
    for o in objects:
        labels = o["metadata"]["labels"]
        assert {k: labels.get(k) for k in standard} == standard, (o["kind"], o["metadata"]["name"])
    [deployment] = of_kind(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert {k: pod_labels.get(k) for k in standard} == standard
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


@pytest.mark.parametrize(
    "variant,scope,peering_kind",
    [
        ("cluster-wide", "--all-namespaces", None),
        ("cluster-wide-ha", "--all-namespaces", "ClusterKopfPeering"),
        ("one-namespace", "--namespace=team-a", None),
        ("one-namespace-ha", "--namespace=team-a", "KopfPeering"),
    ],
)
def test_deployment_flags_say_scope_and_peering_as_the_operator_reads_them(
    render: Render, variant: str, scope: str, peering_kind: str | None
):
    objects = render(*VARIANTS[variant])
    args = deployment_container(objects)["args"]
    peering = f"--peering={FULLNAME}" if peering_kind else "--standalone"
    assert args == [scope, peering, "--liveness=http://0.0.0.0:8080/healthz"]
    ns = parse_args(args)
    assert ns.all_namespaces == (scope == "--all-namespaces")
    assert ns.namespace == ([] if ns.all_namespaces else ["team-a"])
    assert ns.standalone == (peering_kind is None)
    assert [(p["kind"], p["metadata"]["name"]) for p in of_kind(objects, "KopfPeering", "ClusterKopfPeering")] == (
        [(peering_kind, ns.peering)] if peering_kind else []
    )
    [deployment] = of_kind(objects, "Deployment")
    assert deployment["spec"]["strategy"]["type"] == ("RollingUpdate" if peering_kind else "Recreate")


def test_log_level_reaches_the_operators_flags(render: Render):
    assert parse_args(deployment_container(render("--set", "operator.logLevel=debug"))["args"]).debug
    assert parse_args(deployment_container(render("--set", "operator.logLevel=verbose"))["args"]).verbose


def test_operator_values_reach_the_operators_config(render: Render):
    objects = render(
        "--set",
        "operator.gpuResource=amd.com/gpu",
        "--set",
        "operator.routerProbe=false",
        "--set",
        "operator.clusterDomain=example.org",
    )
    env = {e["name"]: e["value"] for e in deployment_container(objects)["env"] if "value" in e}
    cfg = OperatorConfig.from_env(env)
    assert (cfg.gpu_resource, cfg.router_probe, cfg.cluster_domain) == ("amd.com/gpu", False, "example.org")
    defaults = {e["name"]: e["value"] for e in deployment_container(render())["env"] if "value" in e}
    assert replace(OperatorConfig.from_env(defaults), pod_labels=()) == OperatorConfig()


def test_the_operator_knows_its_own_pods_as_a_network_policy_peer(render: Render):
    """The planner reads the workers' /metrics from the operator's pods: the peer a model's NetworkPolicies admit
    is exactly the chart's operator pods, in the release's namespace."""
    objects = render()
    (deploy,) = [o for o in objects if o["kind"] == "Deployment"]
    env = {e["name"]: e for e in deployment_container(objects)["env"]}
    assert env["DISAGG_OPERATOR_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    cfg = OperatorConfig.from_env(
        {"DISAGG_OPERATOR_NAMESPACE": RELEASE_NS, **{k: e["value"] for k, e in env.items() if "value" in e}}
    )
    peer = cfg.pod_peer
    assert peer is not None
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": RELEASE_NS}}
    selector = peer["podSelector"]["matchLabels"]
    assert selector == deploy["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deploy["spec"]["template"]["metadata"]["labels"].items()


def test_dashboards_and_rules_are_off_by_default(render: Render):
    objects = render()
    assert of_kind(objects, "PrometheusRule", "ConfigMap") == []


def test_the_dashboard_reaches_grafanas_sidecar_as_a_labelled_configmap(render: Render):
    objects = render(*VARIANTS["dashboards-and-rules"], "--set", "dashboards.annotations.grafana_folder=LLM")
    [cm] = of_kind(objects, "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["disagg-model.json"]) == json.loads(DASHBOARD.read_text())


def test_the_prometheusrule_holds_the_rules_with_the_thresholds_given(render: Render):
    [rule] = of_kind(render(*VARIANTS["dashboards-and-rules"]), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"] == yaml.safe_load(rules_with_defaults())  # what the promtool and Prometheus tests run
    objects = render(
        *VARIANTS["dashboards-and-rules"],
        "--set",
        "prometheusRule.thresholds.kvUsageRatio=0.8",
        "--set",
        "prometheusRule.labels.release=monitoring",
    )
    [rule] = of_kind(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "monitoring"
    exprs = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert exprs["DisaggKVUsageHigh"] == "disagg:kv_usage:ratio > 0.8"


def test_a_threshold_out_of_range_fails_at_install(render: Render):
    with pytest.raises(AssertionError, match="kvUsageRatio"):
        render("--set", "prometheusRule.enabled=true", "--set", "prometheusRule.thresholds.kvUsageRatio=2")


def test_the_inferencepool_crd_is_installed_only_when_asked_and_kept_on_uninstall(render: Render):
    assert of_kind(render(), "CustomResourceDefinition") == []
    [crd] = of_kind(render(*VARIANTS["inferencepool-crd"]), "CustomResourceDefinition")
    vendored = yaml.safe_load((CHART / "files" / "inference.networking.k8s.io_inferencepools.yaml").read_text())
    assert crd["spec"] == vendored["spec"] and crd["metadata"]["name"] == "inferencepools.inference.networking.k8s.io"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
