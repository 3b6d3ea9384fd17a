#!/usr/bin/env bash
# Run a local Kubernetes control plane as plain processes with kwok:
#   cluster.sh up      create (or reuse) the cluster, print the kubeconfig path
#   cluster.sh down    delete it
#   cluster.sh status  exit 0 when it answers /readyz
#
# etcd, kube-apiserver, kube-controller-manager and kube-scheduler are the real
# components built by build.sh; kwok plays the kubelets of fake GPU nodes;
# the LeaderWorkerSet controller runs beside them (lws.sh).
# Pods reach Running/Ready through kwok's fast stages. Labelling a running pod
# pod-container-running-failed.stage.kwok.x-k8s.io=true makes its containers
# fail (kwok's chaos stage).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CLUSTER_NAME="${DISAGG_CLUSTER_NAME:-disagg}"
CLUSTER_DIR="${DISAGG_CLUSTER_DIR:-$REPO/.cluster}"
NODES="${DISAGG_CLUSTER_NODES:-2}"
KUBECONFIG_PATH="$CLUSTER_DIR/kubeconfig"

# kwokctl keeps pids, logs and etcd data of the cluster under its workdir.
export KWOK_WORKDIR="$CLUSTER_DIR/kwok"

log() { printf '[cluster %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# Start-up deadlines stretch on a loaded machine by the tests' time factor (tests/timing.py): scaled SECONDS.
FACTOR="${DISAGG_TEST_TIME_FACTOR:-1}"
[[ "$FACTOR" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { log "DISAGG_TEST_TIME_FACTOR must be a number >= 1, not '$FACTOR'"; exit 2; }
scaled() { awk -v s="$1" -v f="$FACTOR" 'BEGIN { if (f < 1) f = 1; printf "%d\n", s * f + 0.5 }'; }

bin_dir() {  # build.sh is instant once its stamps exist
  if [[ "${1:-}" == --no-build ]]; then "$HERE/build.sh" --bin-dir; else "$HERE/build.sh" | tail -n 1; fi
}

kubectl() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

running() {
  [[ -f "$KUBECONFIG_PATH" ]] && kubectl get --raw /readyz >/dev/null 2>&1
}

write_config() {  # KwokctlConfiguration plus the complete set of kwok stages
  local stages="$BIN/../share/kwok-stages" f
  {
    cat <<YAML
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokctlConfiguration
options:
  kubeVersion: $("$BIN/kube-apiserver" --version | awk '{print $2}')
  kubectlBinary: $BIN/kubectl
YAML
    for f in "$stages"/*.yaml; do echo "---"; cat "$f"; done
  } >"$CLUSTER_DIR/kwokctl.yaml"
}

add_nodes() {
  local i
  for ((i = 0; i < NODES; i++)); do
    sed "s/NODE_NAME/kwok-gpu-$i/g" "$HERE/node.yaml"; echo "---"
  done | kubectl apply -f - >/dev/null
  # kubectl wait fails at once, instead of waiting, on a node kwok has not given a status yet: poll it.
  local limit start=$SECONDS
  limit=$(scaled 60)
  until kubectl wait --for=condition=Ready node --all --timeout=5s >/dev/null 2>&1; do
    (( SECONDS - start < limit )) || { log "nodes not Ready in ${limit}s"; exit 1; }
    sleep 0.5
  done
}

up() {
  BIN="$(bin_dir)"
  if running; then
    log "reusing running cluster $CLUSTER_NAME"
    "$HERE/lws.sh" up "$KUBECONFIG_PATH"
    echo "$KUBECONFIG_PATH"
    return
  fi
  local start=$SECONDS
  mkdir -p "$CLUSTER_DIR"
  # A stopped or half-created cluster of the same name is replaced.
  "$BIN/kwokctl" delete cluster --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_PATH" >/dev/null 2>&1 || true
  write_config
  log "creating cluster $CLUSTER_NAME"
  "$BIN/kwokctl" create cluster \
    --name "$CLUSTER_NAME" \
    --runtime binary \
    --config "$CLUSTER_DIR/kwokctl.yaml" \
    --kubeconfig "$KUBECONFIG_PATH" \
    --etcd-binary "$BIN/etcd" \
    --kube-apiserver-binary "$BIN/kube-apiserver" \
    --kube-controller-manager-binary "$BIN/kube-controller-manager" \
    --kube-scheduler-binary "$BIN/kube-scheduler" \
    --kwok-controller-binary "$BIN/kwok" \
    --kube-authorization \
    --kube-admission \
    --disable-qps-limits \
    --wait "$(scaled 60)s" >&2
  add_nodes
  # The controller-manager is up once it has created the default ServiceAccount.
  local limit
  limit=$(scaled 90)
  until kubectl get serviceaccount default >/dev/null 2>&1; do
    (( SECONDS - start < limit )) || { log "controller-manager did not start in ${limit}s"; exit 1; }
    sleep 0.5
  done
  "$HERE/lws.sh" up "$KUBECONFIG_PATH"
  log "cluster $CLUSTER_NAME ready with $NODES nodes in $((SECONDS - start))s"
  echo "$KUBECONFIG_PATH"
}

down() {
  "$HERE/lws.sh" down
  BIN="$(bin_dir --no-build)"
  if [[ -x "$BIN/kwokctl" ]]; then
    "$BIN/kwokctl" delete cluster --name "$CLUSTER_NAME" --kubeconfig "$KUBECONFIG_PATH" >&2 || true
  fi
  rm -rf "$KWOK_WORKDIR" "$KUBECONFIG_PATH" "$CLUSTER_DIR/kwokctl.yaml"
  rmdir "$CLUSTER_DIR" 2>/dev/null || true
}

status() {
  BIN="$(bin_dir --no-build)"
  running
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
