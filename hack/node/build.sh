#!/usr/bin/env bash
# Build what a real node needs beside the control plane of hack/k8s/build.sh, from source through the Go
# module proxy, into the same $K8S_BIN_DIR:
#   kubelet, kube-proxy  k8s.io/kubernetes at the control plane's version, built in a copy of the control
#                        plane's wrapper module (same go.mod, so the same module versions and build flags)
#   kube-router          its network policy controller is the node's NetworkPolicy enforcer
#   coredns              a wrapper main with the plugins the node's Corefile uses
#   pause                Kubernetes' build/pause/linux/pause.c, compiled static with gcc
# and the two images the node runs from them (pause, coredns) into buildah's storage.
# Idempotent: a stamp per component and version, as in hack/k8s/build.sh.
# Prints $K8S_BIN_DIR on its last line.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck source=hack/node/versions.sh
source "$HERE/versions.sh"

log() { printf '[node-build %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# The control plane first: its wrapper module is what kubelet and kube-proxy are built in.
BIN_DIR="$("$REPO/hack/k8s/build.sh" | tail -n 1)"
CACHE_ROOT="$(dirname "$BIN_DIR")"
STAMP_DIR="$CACHE_ROOT/stamps"
SRC_DIR="$CACHE_ROOT/src"
K8S_WRAPPER="$SRC_DIR/kubernetes-$K8S_VERSION"

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0

exec 9>"$CACHE_ROOT/.lock"  # the lock hack/k8s/build.sh holds while it builds
flock 9

up_to_date() {
  local name=$1 version=$2; shift 2
  [[ -f "$STAMP_DIR/$name-$version" ]] || return 1
  local b; for b in "$@"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
}
stamp() { date -u +%FT%TZ >"$STAMP_DIR/$1-$2"; }
json_field() { sed -n "s/^\s*\"$1\": \"\(.*\)\",\?\$/\1/p"; }
module_dir() { (cd "$SRC_DIR" && go mod download -json "$1@$2") | json_field Dir; }

build_kubelet() {
  up_to_date kubelet "$K8S_VERSION" kubelet kube-proxy && return
  [[ -f "$K8S_WRAPPER/go.mod" ]] || {
    log "$K8S_WRAPPER/go.mod is missing: remove $STAMP_DIR/kubernetes-$K8S_VERSION and run hack/k8s/build.sh"
    exit 1
  }
  log "building kubelet and kube-proxy $K8S_VERSION"
  local dir="$SRC_DIR/node-$K8S_VERSION" minor ldflags=("-s" "-w") p
  rm -rf "$dir" && mkdir -p "$dir"
  cp "$K8S_WRAPPER/go.mod" "$K8S_WRAPPER/go.sum" "$dir/"
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=("-X" "$p.gitVersion=$K8S_VERSION" "-X" "$p.gitMajor=1" "-X" "$p.gitMinor=$minor"
              "-X" "$p.gitTreeState=clean" "-X" "$p.buildDate=1970-01-01T00:00:00Z")
  done
  (cd "$dir" && go build -trimpath -ldflags "${ldflags[*]}" -o "$BIN_DIR/" \
     k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy)
  stamp kubelet "$K8S_VERSION"
}

build_kube_router() {
  up_to_date kube-router "$KUBE_ROUTER_VERSION" kube-router && return
  log "building kube-router $KUBE_ROUTER_VERSION"
  GOBIN="$BIN_DIR" go install -trimpath \
    -ldflags "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
  stamp kube-router "$KUBE_ROUTER_VERSION"
}

# CoreDNS's own main links every plugin (cloud DNS providers included); this one links the plugins
# the node's Corefile names, so the build fetches and compiles a fraction of it.
build_coredns() {
  up_to_date coredns "$COREDNS_VERSION" coredns && return
  log "building coredns $COREDNS_VERSION"
  local dir="$SRC_DIR/coredns-$COREDNS_VERSION" p
  rm -rf "$dir" && mkdir -p "$dir"
  printf 'module disagg.local/coredns\n\ngo 1.26.0\n\nrequire github.com/coredns/coredns %s\n' \
    "$COREDNS_VERSION" >"$dir/go.mod"
  {
    echo '// Command coredns is CoreDNS with the plugins of hack/node/coredns.yaml.'
    echo 'package main'
    echo
    echo 'import ('
    echo '	"github.com/coredns/coredns/coremain"'
    for p in $COREDNS_PLUGINS; do echo "	_ \"github.com/coredns/coredns/plugin/$p\""; done
    echo ')'
    echo
    echo 'func main() { coremain.Run() }'
  } >"$dir/main.go"
  (cd "$dir" && go mod tidy && go build -trimpath -ldflags "-s -w" -o "$BIN_DIR/coredns" .)
  stamp coredns "$COREDNS_VERSION"
}

build_pause() {
  up_to_date pause "$PAUSE_VERSION" pause && return
  log "building pause $PAUSE_VERSION"
  local src
  src=$(module_dir k8s.io/kubernetes "$K8S_VERSION")/build/pause/linux/pause.c
  gcc -Os -Wall -Werror -static -DVERSION="v$PAUSE_VERSION-disagg" -o "$BIN_DIR/pause" "$src"
  strip "$BIN_DIR/pause"
  stamp pause "$PAUSE_VERSION"
}

# image NAME BINARY ENTRYPOINT: a one-file image (a static binary FROM scratch) in buildah's storage.
image() {
  local name=$1 binary=$2 ctr
  buildah inspect --type image "$name" >/dev/null 2>&1 &&
    [[ "$(buildah inspect --type image --format '{{index .ImageAnnotations "disagg.local/binary-sha256"}}' "$name")" == \
       "$(sha256sum <"$BIN_DIR/$binary" | cut -d' ' -f1)" ]] && return
  log "building image $name"
  ctr=$(buildah from scratch)
  buildah copy --quiet --chmod 0755 "$ctr" "$BIN_DIR/$binary" "/$binary" >/dev/null
  buildah config --entrypoint "[\"/$binary\"]" --cmd '' \
    --annotation "disagg.local/binary-sha256=$(sha256sum <"$BIN_DIR/$binary" | cut -d' ' -f1)" "$ctr"
  buildah commit --quiet --rm "$ctr" "$name" >/dev/null
}

start=$SECONDS
build_kubelet
build_kube_router
build_coredns
build_pause
image "$PAUSE_IMAGE" pause
image "$COREDNS_IMAGE" coredns
log "done in $((SECONDS - start))s"
echo "$BIN_DIR"
