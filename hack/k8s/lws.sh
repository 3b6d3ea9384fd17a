#!/usr/bin/env bash
# LeaderWorkerSet (sigs.k8s.io/lws) in the local cluster: its CRD, its webhooks and its controller, built by
# build.sh from its released module, run as a local process like the rest of the control plane.
#   lws.sh up KUBECONFIG     install the CRD and webhooks, start the controller, wait until it serves
#   lws.sh down              stop the controller
#
# The API server reaches the webhooks at https://127.0.0.1:$LWS_WEBHOOK_PORT, with a CA made here (LWS's own
# certificate rotation serves a Service name, which a controller outside the cluster does not have). The pod
# webhooks see only pods of a LeaderWorkerSet (their objectSelector), as LWS's own manifests have it.
#
# The webhook and health ports are the first ports from LWS_WEBHOOK_PORT / LWS_HEALTH_PORT (19443 / 18081) up
# that nothing listens on: clusters of other checkouts run on the same machine, and a controller that cannot bind
# a port another one holds exits while that other one answers /readyz, so the webhooks registered here would reach
# the other cluster's controller (whose CA this API server does not trust: every LeaderWorkerSet write refused).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CLUSTER_DIR="${DISAGG_CLUSTER_DIR:-$REPO/.cluster}"
DIR="$CLUSTER_DIR/lws"
FACTOR="${DISAGG_TEST_TIME_FACTOR:-1}"

log() { printf '[lws %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

free_port() {  # PORT: the first port from PORT up that nothing on 127.0.0.1 listens on
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}
scaled() { awk -v s="$1" -v f="$FACTOR" 'BEGIN { if (f < 1) f = 1; printf "%d\n", s * f + 0.5 }'; }

certs() {
  mkdir -p "$DIR/certs"
  openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=disagg-lws-ca" \
    -keyout "$DIR/certs/ca.key" -out "$DIR/certs/ca.crt" 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$DIR/certs/tls.key" -out "$DIR/certs/tls.csr" 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1\n' >"$DIR/certs/san.ext"
  openssl x509 -req -in "$DIR/certs/tls.csr" -CA "$DIR/certs/ca.crt" -CAkey "$DIR/certs/ca.key" \
    -CAcreateserial -days 30 -extfile "$DIR/certs/san.ext" -out "$DIR/certs/tls.crt" 2>/dev/null
}

webhook() {  # NAME PATH RESOURCE-GROUP RESOURCE OPERATIONS [pods]
  local ca
  ca=$(base64 -w0 <"$DIR/certs/ca.crt")
  cat <<YAML
- name: $1
  admissionReviewVersions: ["v1"]
  clientConfig:
    url: https://127.0.0.1:$PORT$2
    caBundle: $ca
  failurePolicy: Fail
  sideEffects: None
  rules:
  - apiGroups: ["$3"]
    apiVersions: ["v1"]
    operations: [$5]
    resources: ["$4"]
YAML
  if [[ "${6:-}" == pods ]]; then
    cat <<'YAML'
  objectSelector:
    matchExpressions:
    - key: leaderworkerset.sigs.k8s.io/name
      operator: Exists
YAML
  fi
}

webhooks() {
  cat <<YAML
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: disagg-lws-mutating
webhooks:
$(webhook mleaderworkerset.kb.io /mutate-leaderworkerset-x-k8s-io-v1-leaderworkerset leaderworkerset.x-k8s.io leaderworkersets '"CREATE", "UPDATE"')
$(webhook mpod.kb.io /mutate--v1-pod "" pods '"CREATE", "UPDATE"' pods)
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: disagg-lws-validating
webhooks:
$(webhook vleaderworkerset.kb.io /validate-leaderworkerset-x-k8s-io-v1-leaderworkerset leaderworkerset.x-k8s.io leaderworkersets '"CREATE", "UPDATE"')
$(webhook vpod.kb.io /validate--v1-pod "" pods '"CREATE", "UPDATE"' pods)
YAML
}

up() {
  local kubeconfig=$1 bin share
  bin="$("$HERE/build.sh" --bin-dir)"
  share="$(dirname "$bin")/share/lws"
  [[ -x "$bin/lws-controller" && -f "$share/crd.yaml" ]] || { log "lws-controller is not built (hack/k8s/build.sh)"; exit 1; }
  down
  PORT=$(free_port "${LWS_WEBHOOK_PORT:-19443}")
  HEALTH=$(free_port "${LWS_HEALTH_PORT:-18081}")
  mkdir -p "$DIR"
  certs
  cat >"$DIR/config.yaml" <<YAML
apiVersion: config.lws.x-k8s.io/v1alpha1
kind: Configuration
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: false
webhook:
  host: 127.0.0.1
  port: $PORT
  certDir: $DIR/certs
metrics:
  bindAddress: "0"
health:
  healthProbeBindAddress: 127.0.0.1:$HEALTH
YAML
  "$bin/kubectl" --kubeconfig "$kubeconfig" apply --server-side -f "$share/crd.yaml" >/dev/null
  local limit start=$SECONDS
  limit=$(scaled 60)
  # kubectl wait fails at once, instead of waiting, on a CRD without conditions yet: poll it.
  until "$bin/kubectl" --kubeconfig "$kubeconfig" wait --for=condition=Established \
      crd/leaderworkersets.leaderworkerset.x-k8s.io --timeout=5s >/dev/null 2>&1; do
    (( SECONDS - start < limit )) || { log "the LeaderWorkerSet CRD not Established in ${limit}s"; exit 1; }
    sleep 0.5
  done
  # Without the callers' lock descriptors (node.sh holds fd 8, build.sh fd 9): the controller outlives them.
  KUBECONFIG="$kubeconfig" setsid "$bin/lws-controller" --config "$DIR/config.yaml" --zap-log-level=info \
    >"$DIR/controller.log" 2>&1 </dev/null 8>&- 9>&- &
  echo $! >"$DIR/pid"
  start=$SECONDS
  alive() {
    kill -0 "$(<"$DIR/pid")" 2>/dev/null && return
    log "lws-controller exited:"; tail -20 "$DIR/controller.log" >&2; exit 1
  }
  until curl -fsS "http://127.0.0.1:$HEALTH/readyz" >/dev/null 2>&1; do
    alive
    (( SECONDS - start < limit )) || { log "lws-controller not ready in ${limit}s"; exit 1; }
    sleep 0.5
  done
  # A port taken between free_port and the bind: what answered was another controller, and this one has exited.
  sleep 0.5
  alive
  # The webhooks go in once the controller serves them: with failurePolicy Fail, earlier LWS writes would fail.
  webhooks | "$bin/kubectl" --kubeconfig "$kubeconfig" apply -f - >/dev/null
  log "LeaderWorkerSet controller up in $((SECONDS - start))s (webhooks on 127.0.0.1:$PORT, health on :$HEALTH)"
}

down() {
  if [[ -f "$DIR/pid" ]]; then
    local pid
    pid=$(<"$DIR/pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$DIR/pid"
  fi
}

case "${1:-}" in
  up) up "${2:?usage: $0 up KUBECONFIG}" ;;
  down) down ;;
  *) echo "usage: $0 up KUBECONFIG|down" >&2; exit 2 ;;
esac
