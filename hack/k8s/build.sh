#!/usr/bin/env bash
# Build a local Kubernetes control plane from source through the Go module proxy:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok,
# kwokctl, helm and the LeaderWorkerSet controller. Binaries land in $K8S_BIN_DIR (printed on the last line;
# `build.sh --bin-dir` prints it without building).
#
# Idempotent: every component has a stamp file named after its version, so a
# second run with the same versions does nothing. Module and build caches stay
# in Go's default locations so they stay warm across versions.
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.36.3}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
HELM_VERSION="${HELM_VERSION:-v3.22.0}"
LWS_VERSION="${LWS_VERSION:-v0.7.0}"
# ETCD_VERSION defaults to the go.etcd.io/etcd/server/v3 version that
# k8s.io/kubernetes itself requires, so apiserver and etcd match.
ETCD_VERSION="${ETCD_VERSION:-}"

CACHE_ROOT="${DISAGG_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/k8s}/${K8S_VERSION}"
BIN_DIR="${K8S_BIN_DIR:-$CACHE_ROOT/bin}"
STAMP_DIR="$CACHE_ROOT/stamps"
SRC_DIR="$CACHE_ROOT/src"

if [[ "${1:-}" == --bin-dir ]]; then  # where the binaries are (or will be); builds nothing
  echo "$BIN_DIR"
  exit 0
fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
mkdir -p "$BIN_DIR" "$STAMP_DIR" "$SRC_DIR"

log() { printf '[k8s-build %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# up_to_date NAME VERSION BIN... : stamp present and every binary executable.
up_to_date() {
  local name=$1 version=$2; shift 2
  [[ -f "$STAMP_DIR/$name-$version" ]] || return 1
  local b; for b in "$@"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
}

K8S_BINS=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
SHARE_DIR="$(dirname "$BIN_DIR")/share"

# Every component stamped (a stamp is written once its build is complete): nothing to build, so nothing to wait
# for. A cluster needs only these binaries, and the lock below is also held by hack/node/build.sh while it
# builds the node's (minutes on a fresh machine): the cluster tier starts meanwhile.
everything_up_to_date() {
  local etcd=${ETCD_VERSION:-$(cat "$CACHE_ROOT/etcd-version" 2>/dev/null || true)}
  [[ -n "$etcd" ]] && up_to_date etcd "$etcd" etcd && up_to_date kwok "$KWOK_VERSION" kwok kwokctl &&
    up_to_date kwok-stages "$KWOK_VERSION" && [[ -d "$SHARE_DIR/kwok-stages" ]] &&
    up_to_date helm "$HELM_VERSION" helm && up_to_date kubernetes "$K8S_VERSION" "${K8S_BINS[@]}" &&
    up_to_date lws "$LWS_VERSION" lws-controller && [[ -f "$SHARE_DIR/lws/crd.yaml" ]]
}
if everything_up_to_date; then
  echo "$BIN_DIR"
  exit 0
fi

# Serialise concurrent builds (make and pytest may both ask for one).
exec 9>"$CACHE_ROOT/.lock"
flock 9

stamp() { date -u +%FT%TZ >"$STAMP_DIR/$1-$2"; }

json_field() { sed -n "s/^\s*\"$1\": \"\(.*\)\",\?\$/\1/p"; }
# The .mod file the proxy serves for MODULE VERSION (fetches only that file).
module_gomod() { (cd "$SRC_DIR" && go list -m -json "$1@$2") | json_field GoMod; }
# The extracted source of MODULE VERSION.
module_dir() { (cd "$SRC_DIR" && go mod download -json "$1@$2") | json_field Dir; }

k8s_gomod() { module_gomod k8s.io/kubernetes "$K8S_VERSION"; }

resolve_etcd_version() {  # remembered, so a warm run needs no module look-up
  [[ -n "$ETCD_VERSION" ]] && return
  local file="$CACHE_ROOT/etcd-version"
  [[ -s "$file" ]] || awk '$1 == "go.etcd.io/etcd/server/v3" {print $2; exit}' "$(k8s_gomod)" >"$file"
  ETCD_VERSION=$(<"$file")
  [[ -n "$ETCD_VERSION" ]] || { log "cannot find etcd server version in k8s.io/kubernetes@$K8S_VERSION go.mod"; exit 1; }
}

build_etcd() {
  up_to_date etcd "$ETCD_VERSION" etcd && return
  log "building etcd $ETCD_VERSION"
  local dir="$SRC_DIR/etcd-$ETCD_VERSION"
  rm -rf "$dir" && mkdir -p "$dir"
  cat >"$dir/go.mod" <<MOD
module disagg.local/etcd

go 1.24.0

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
MOD
  cat >"$dir/main.go" <<'SRC'
// Command etcd is etcd's own entry point, built from the released server module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
SRC
  (cd "$dir" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/etcd" .)
  stamp etcd "$ETCD_VERSION"
}

build_kwok() {
  up_to_date kwok "$KWOK_VERSION" kwok kwokctl && return
  log "building kwok and kwokctl $KWOK_VERSION"
  GOBIN="$BIN_DIR" go install -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=$KWOK_VERSION" \
    "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@$KWOK_VERSION"
  stamp kwok "$KWOK_VERSION"
}

# kwokctl replaces all of its default stages as soon as a config names one, so
# ship kwok's own fast node/pod stages plus the container-failure chaos stage
# for cluster.sh to hand over as a whole.
install_kwok_stages() {
  [[ -f "$STAMP_DIR/kwok-stages-$KWOK_VERSION" && -d "$(dirname "$BIN_DIR")/share/kwok-stages" ]] && return
  local src dst f
  dst="$(dirname "$BIN_DIR")/share/kwok-stages"  # cluster.sh looks beside the bin dir
  src=$(module_dir sigs.k8s.io/kwok "$KWOK_VERSION")/kustomize/stage
  rm -rf "$dst" && mkdir -p "$dst"
  for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml \
           pod/chaos/pod-container-running-failed.yaml; do
    install -m 0644 "$src/$f" "$dst/$(basename "$f")"
  done
  stamp kwok-stages "$KWOK_VERSION"
}

build_helm() {
  up_to_date helm "$HELM_VERSION" helm && return
  log "building helm $HELM_VERSION"
  GOBIN="$BIN_DIR" go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  stamp helm "$HELM_VERSION"
}

# The LeaderWorkerSet controller (lws.sh runs it) and its CRD, from the released module.
build_lws() {
  local share
  share="$(dirname "$BIN_DIR")/share/lws"
  up_to_date lws "$LWS_VERSION" lws-controller && [[ -f "$share/crd.yaml" ]] && return
  log "building the LeaderWorkerSet controller $LWS_VERSION"
  local src
  src=$(module_dir sigs.k8s.io/lws "$LWS_VERSION")
  (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/lws-controller" ./cmd)
  rm -rf "$share" && mkdir -p "$share"
  install -m 0644 "$src/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$share/crd.yaml"
  stamp lws "$LWS_VERSION"
}

# Write a wrapper go.mod that requires k8s.io/kubernetes and replaces each
# staging module (a v0.0.0 requirement in the released go.mod) with its
# published v0.Y.Z tag.
write_k8s_wrapper() {
  local dir=$1 gomod staging_version
  gomod=$(k8s_gomod)
  staging_version="v0.${K8S_VERSION#v1.}"
  {
    echo "module disagg.local/kubernetes"
    echo
    awk '$1 == "go" {print; exit}' "$gomod"
    awk '$1 == "godebug" {print}' "$gomod"
    echo
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo
    echo "replace ("
    awk '{ if ($1 == "require") { m = $2; v = $3 } else { m = $1; v = $2 } }
         m ~ /^k8s\.io\// && v == "v0.0.0" { print m }' "$gomod" | sort -u |
      while read -r m; do printf '\t%s => %s %s\n' "$m" "$m" "$staging_version"; done
    echo ")"
  } >"$dir/go.mod"
}

build_k8s() {
  local bins=("${K8S_BINS[@]}")
  up_to_date kubernetes "$K8S_VERSION" "${bins[@]}" && return
  log "building ${bins[*]} $K8S_VERSION"
  local dir="$SRC_DIR/kubernetes-$K8S_VERSION" minor pkgs=() b ldflags=("-s" "-w")
  rm -rf "$dir" && mkdir -p "$dir"
  write_k8s_wrapper "$dir"
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=("-X" "$p.gitVersion=$K8S_VERSION" "-X" "$p.gitMajor=1" "-X" "$p.gitMinor=$minor"
              "-X" "$p.gitTreeState=clean" "-X" "$p.buildDate=1970-01-01T00:00:00Z")
  done
  for b in "${bins[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
  (cd "$dir" && go get "${pkgs[@]/%/@$K8S_VERSION}" &&
     go build -trimpath -ldflags "${ldflags[*]}" -o "$BIN_DIR/" "${pkgs[@]}")
  stamp kubernetes "$K8S_VERSION"
}

start=$SECONDS
resolve_etcd_version
build_etcd
build_kwok
install_kwok_stages
build_helm
build_k8s
build_lws
log "done in $((SECONDS - start))s"
echo "$BIN_DIR"
