#!/usr/bin/env bash
# Builds the product's images without a Docker daemon, with buildah (Debian's package):
#   1. a Python base image from Debian's own packages (mmdebstrap of bookworm: python3.11, venv,
#      python-is-python3), since no image registry is reachable here; the Dockerfiles take it through
#      their PYTHON_IMAGE argument and stay correct for `docker build` on the public python image;
#   2. Dockerfile.worker (torch from PyPI: TORCH_INDEX empty) and Dockerfile.operator, tagged with the
#      names the chart and examples use (ghcr.io/disagg/{worker,operator}:VERSION);
#   3. on request only (`envoy`), the e2e tier's gateway: tests/e2e/Dockerfile.envoy, tagged $ENVOY_IMAGE.
# Layers are cached by buildah (--layers): a change to the project's code rebuilds its own layer only.
# Usage: hack/images/build.sh [base|worker|operator|all|envoy] (default all); prints each image's name and size.
set -euo pipefail
cd "$(dirname "$0")/../.."

VERSION=${VERSION:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
REGISTRY=${REGISTRY:-ghcr.io/disagg}
BASE_IMAGE=${BASE_IMAGE:-localhost/disagg-python:3.11-bookworm}
ENVOY_IMAGE=${ENVOY_IMAGE:-localhost/disagg-e2e-envoy:1.40.0}
CACHE=${DISAGG_IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/disagg/images}
# pip's cache on this machine, shared with the builds: torch and its CUDA libraries download once.
PIP_CACHE=${PIP_CACHE:-$(pip3 cache dir 2>/dev/null || echo "${XDG_CACHE_HOME:-$HOME/.cache}/pip")}
mkdir -p "$PIP_CACHE"
# PyPI's Linux torch is the CUDA build; the CPU index is not reachable from every machine.
TORCH_INDEX=${TORCH_INDEX:-}

# Where PyPI is reached through a TLS-inspecting proxy, the builds trust what this machine trusts: its CA
# bundle is mounted into each build step (never into an image) and pip is pointed at it.
HOST_CA=${HOST_CA:-/etc/ssl/certs/ca-certificates.crt}

log() { echo "[images] $*" >&2; }

exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }

base() {
    if exists "$BASE_IMAGE"; then return; fi
    mkdir -p "$CACHE"
    local tar=$CACHE/bookworm-python.tar
    if [ ! -f "$tar" ]; then
        log "mmdebstrap: bookworm with python3 into $tar"
        mmdebstrap --quiet --variant=minbase --aptopt='APT::Install-Recommends "false"' \
            --include=python3,python3-venv,python-is-python3,ca-certificates \
            bookworm "$tar.part"
        mv "$tar.part" "$tar"
    fi
    local ctr
    ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$tar" / >/dev/null
    buildah config --env LANG=C.UTF-8 \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd python "$ctr"
    buildah commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
    log "built $BASE_IMAGE"
}

image() { # name dockerfile build-args...  (the image's name: $REGISTRY/name:$VERSION, or $TAG when set)
    local name=$1 file=$2 final=${TAG:-$REGISTRY/$1:$VERSION}
    shift 2
    local start=$SECONDS
    # runc, not crun: crun refuses a machine that mounts cgroup v1 beside an empty cgroup2 (hybrid mode).
    local args=(--quiet --layers --network host --pull-never --runtime runc -f "$file"
        --volume "$HOST_CA:/etc/ssl/certs/host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/certs/host-ca.crt
        --volume "$PIP_CACHE:/var/cache/host-pip" --build-arg PIP_CACHE_DIR=/var/cache/host-pip
        --build-arg "PYTHON_IMAGE=$BASE_IMAGE" "$@")
    # Every named stage gets a name of its own, so that it stays as build cache: the dependencies (torch and
    # its libraries, gigabytes and minutes to install), the project, the demo model.
    local stage tag id tags=() before=()
    for stage in $(sed -n 's/^FROM .* AS \([a-z0-9_-]*\)$/\1/p' "$file"); do tags+=("localhost/disagg-$name-$stage:cache"); done
    tags+=("$final")
    for tag in "${tags[@]}"; do
        before=("$(buildah inspect --type image --format '{{.FromImageID}}' "$tag" 2>/dev/null || true)" "${before[@]}")
    done
    for tag in "${tags[@]}"; do
        stage=${tag#localhost/disagg-"$name"-}
        if [[ $stage == "$tag" ]]; then
            buildah build "${args[@]}" -t "$tag" . >/dev/null
        else
            buildah build "${args[@]}" --target "${stage%:cache}" -t "$tag" . >/dev/null
        fi
    done
    log "built $final in $((SECONDS - start)) s"
    # What these names pointed at before and no longer do goes, last stage first, with the layers only it
    # used: a worker image whose dependencies changed would leave gigabytes behind on every build. An image
    # that still has a name or a child stays (rmi refuses it).
    local now=" "
    for tag in "${tags[@]}"; do now+="$(buildah inspect --type image --format '{{.FromImageID}}' "$tag") "; done
    for id in "${before[@]}"; do
        [[ -n $id && $now != *" $id "* ]] || continue  # rmi of an image by ID would take its names too
        buildah rmi "$id" >/dev/null 2>&1 || true
    done
}

size() {
    buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -F "$REGISTRY/$1:$VERSION" || true
}

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"  # one build at a time: a second waits for the first's images
flock 9

what=${1:-all}
case $what in
base) base ;;
worker)
    base
    image worker Dockerfile.worker --build-arg "TORCH_INDEX=$TORCH_INDEX"
    size worker
    ;;
operator)
    base
    image operator Dockerfile.operator
    size operator
    ;;
all)
    base
    image operator Dockerfile.operator
    image worker Dockerfile.worker --build-arg "TORCH_INDEX=$TORCH_INDEX"
    size operator
    size worker
    ;;
envoy)
    base
    TAG=$ENVOY_IMAGE image envoy tests/e2e/Dockerfile.envoy
    buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -F "$ENVOY_IMAGE" || true
    ;;
*)
    echo "usage: $0 [base|worker|operator|all|envoy]" >&2
    exit 2
    ;;
esac
