"""Run kubeconform and kube-score over the YAML files render.py wrote; fail on anything not kept on purpose.

- kubeconform -strict, offline: Kubernetes objects against the strict schemas of the Kubernetes version the
  product targets, custom resources against JSON schemas converted from the project's own CRDs (and the chart's
  kopf peering CRD, and the Prometheus operator's PrometheusRule CRD that tools.sh fetches) by kubeconform's
  openapi2jsonschema.py. A missing schema is an error.
- kube-score, each file on its own, with `OPTIONAL_CHECKS` on too, and the checks of checks.py (kube-linter's
  unhealthy-pod eviction policy among them). Every finding must match an entry of the
  kept-findings file (check id, the finding's summary, and an object pattern), and every entry must still match
  some finding, so the file lists exactly what the product keeps, each with its reason.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import yaml
from checks import run as own_checks

REPO = Path(__file__).resolve().parents[2]
CRD_DIRS = (REPO / "crds", REPO / "charts" / "disagg-operator" / "crds")
# The kinds spec.gateway makes beside the product's: the InferencePool (its CRD ships with the chart) and the
# HTTPRoute (the Gateway API v1.6.3 CRDs the cluster tier installs).
GATEWAY_CRDS = (
    REPO / "charts" / "disagg-operator" / "files",
    REPO / "tests" / "cluster" / "testdata" / "gateway-api-v1.6.3",
)
KUBERNETES_VERSION = "v1.36.0"
OPTIONAL_CHECKS = ("container-seccomp-profile",)


@dataclass(frozen=True)
class Finding:
    file: str
    obj: str  # Kind/name
    check: str
    summary: str
    path: str

    def __str__(self) -> str:
        where = f" ({self.path})" if self.path else ""
        return f"{self.file}: {self.obj}{where}: [{self.check}] {self.summary}"


def crd_schemas(tools: Path, out: Path) -> None:
    """JSON schemas of every CRD the project ships or renders objects of, named group_kind_version.json."""
    files = sorted({str(f) for d in (*CRD_DIRS, *GATEWAY_CRDS, tools / "crds") for f in d.glob("*.yaml")})
    env = {**os.environ, "FILENAME_FORMAT": "{fullgroup}_{kind}_{version}"}
    cmd = [sys.executable, str(tools / "openapi2jsonschema.py"), *files]
    subprocess.run(cmd, cwd=out, env=env, check=True, capture_output=True, text=True)


def kubeconform(tools: Path, manifests: list[Path], crds: Path) -> bool:
    cmd = [
        str(tools / "bin" / "kubeconform"),
        "-strict",
        "-summary",
        "-kubernetes-version",
        KUBERNETES_VERSION.lstrip("v"),
        "-schema-location",
        str(tools / "schemas" / "kubernetes" / "{{ .ResourceKind }}{{ .KindSuffix }}.json"),
        "-schema-location",
        str(crds / "{{ .Group }}_{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json"),
        *map(str, manifests),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print((proc.stdout.strip() or proc.stderr.strip()).replace("\n\n", "\n"))
    return proc.returncode == 0


def kube_score(tools: Path, manifest: Path) -> list[Finding]:
    minor = KUBERNETES_VERSION.rsplit(".", 1)[0]  # kube-score takes vN.NN
    cmd = [str(tools / "bin" / "kube-score"), "score", "-o", "json", "--kubernetes-version", minor]
    cmd += [arg for check in OPTIONAL_CHECKS for arg in ("--enable-optional-test", check)]
    proc = subprocess.run([*cmd, str(manifest)], capture_output=True, text=True)
    if proc.returncode not in (0, 1) or not proc.stdout:  # 1: it found something
        raise SystemExit(f"kube-score failed on {manifest}: {proc.stderr}")
    out = []
    for obj in json.loads(proc.stdout):
        name = f"{obj['type_meta']['kind']}/{obj['object_meta']['name']}"
        for c in obj["checks"]:
            if c["skipped"] or c["grade"] >= 10:
                continue
            for comment in c["comments"] or [{"summary": c["check"]["name"], "path": ""}]:
                out.append(Finding(manifest.name, name, c["check"]["id"], comment["summary"], comment["path"]))
    return out


def project_checks(manifest: Path) -> list[Finding]:
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    return [Finding(manifest.name, obj, check, summary, "") for check, obj, summary in own_checks(docs)]


def kept(entry: dict, f: Finding) -> bool:
    return (
        entry["check"] == f.check
        and entry["summary"] == f.summary
        and any(fnmatch(f"{f.file}:{f.obj}", pattern) for pattern in entry.get("objects", ["*"]))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", type=Path, required=True, help="the cache hack/manifests/tools.sh printed")
    parser.add_argument("--kept", type=Path, required=True, help="the kept-findings file")
    parser.add_argument("manifests", type=Path, nargs="+")
    args = parser.parse_args()
    entries = yaml.safe_load(args.kept.read_text())
    with tempfile.TemporaryDirectory() as crds:
        crd_schemas(args.tools, Path(crds))
        valid = kubeconform(args.tools, args.manifests, Path(crds))
    findings = [f for m in args.manifests for f in kube_score(args.tools, m) + project_checks(m)]
    unkept = [f for f in findings if not any(kept(e, f) for e in entries)]
    stale = [e for e in entries if not any(kept(e, f) for f in findings)]
    for f in unkept:
        print(f"finding: {f}")
    for e in stale:
        print(f"kept finding matches nothing any more, remove it from {args.kept}: [{e['check']}] {e['summary']}")
    n = len(findings)
    print(f"kube-score and checks.py: {n} findings, {n - len(unkept)} kept on purpose, {len(unkept)} not")
    return 0 if valid and not unkept and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
