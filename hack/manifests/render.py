"""Everything a cluster admin is handed, written as YAML for the manifest linters (`make lint-manifests`).

One file per set, since kube-score's checks across objects (a PDB for each workload, a NetworkPolicy for each
pod) look within one run:
- chart-default.yaml, chart-ha.yaml, chart-observability.yaml: `helm template` of the chart, CRDs included, with
  default values, replicas=2, and its Grafana dashboard and PrometheusRule on;
- examples.yaml: every document in examples/, and for each DisaggregatedModel the children the operator's own
  builders make of it (the generated auth Secret and the prefill RoleScaler included);
- one file per CR in hack/manifests/crs/ (a GPU-shaped, a multi-replica, a gateway-served and a LoRA-serving
  model), the CR and its children.
"""

import argparse
import subprocess
from pathlib import Path
from typing import Any

import yaml

from disagg_operator import names
from disagg_operator.builders import build_auth_secret, build_children, build_gateway_children, build_role_scaler
from disagg_operator.config import OperatorConfig
from disagg_operator.spec import ModelSpec

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg-operator"
NAMESPACE = "models"
CHART_VALUES = {
    "chart-default": [],
    "chart-ha": ["--set", "replicas=2"],
    "chart-observability": ["--set", "dashboards.enabled=true", "--set", "prometheusRule.enabled=true"],
}


def operator_children(cr: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator applies for `cr`, in the namespace it would run in (with `spec.gateway`, the pool's
    objects too)."""
    cr = {**cr, "metadata": {**cr["metadata"], "namespace": NAMESPACE, "uid": "00000000-0000-0000-0000-000000000001"}}
    spec = ModelSpec.from_cr(cr)
    return [
        *build_children(spec, OperatorConfig()),
        *build_gateway_children(spec, OperatorConfig()),
        build_auth_secret(spec, "token"),
        build_role_scaler(spec, names.PREFILL),
    ]


def with_children(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for doc in docs:
        out.append(doc)
        if doc.get("kind") == names.KIND:
            out += operator_children(doc)
    return out


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def helm_template(helm: str, values: list[str]) -> str:
    cmd = [helm, "template", "disagg", str(CHART), "--namespace", "disagg-system", "--include-crds", *values]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout


def render(out: Path, helm: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, values in CHART_VALUES.items():
        written.append(out / f"{name}.yaml")
        written[-1].write_text(helm_template(helm, values))
    sets = {"examples": [d for p in sorted((REPO / "examples").glob("*.yaml")) for d in load(p)]}
    sets |= {f"cr-{p.stem}": load(p) for p in sorted((Path(__file__).parent / "crs").glob("*.yaml"))}
    for name, docs in sets.items():
        written.append(out / f"{name}.yaml")
        written[-1].write_text(yaml.safe_dump_all(with_children(docs), sort_keys=False))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the YAML files")
    parser.add_argument("--helm", default="helm", help="the helm binary")
    args = parser.parse_args()
    for path in render(args.out, args.helm):
        print(path)


if __name__ == "__main__":
    main()
