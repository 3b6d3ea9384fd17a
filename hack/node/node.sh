#!/usr/bin/env bash
# A real Kubernetes node on this machine, beside a control plane of its own:
#   node.sh up [--no-build]   start it (or reuse a running one); prints the kubeconfig path
#   node.sh down              stop it and remove everything it added to the machine
#   node.sh status            exit 0 when the API answers and the node is Ready
#   node.sh import IMAGE...   copy images from buildah's storage into the node's containerd
#   node.sh tag IMAGE NAME    give an image in containerd another name (nothing copied)
#
# Processes: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the LeaderWorkerSet controller
# (as hack/k8s/build.sh built them), containerd and runc (Debian's), kubelet and kube-proxy (hack/node/build.sh),
# kube-router's network policy controller, and CoreDNS as a pod. Pods live on the bridge $BRIDGE, which nothing routes out of.
# Every setting and its reason: hack/node/README-node.md.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
# shellcheck source=hack/node/versions.sh
source "$HERE/versions.sh"

NODE_NAME=disagg-node
BRIDGE=disagg0
NODE_IP=10.244.0.1            # the machine's address on the bridge: API server, kubelet, node IP
POD_SUBNET=10.244.0.0/24
POD_RANGE_START=10.244.0.10
CLUSTER_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
DNS_IP=10.96.0.10
ETCD_PORT=12379 ETCD_PEER_PORT=12380 API_PORT=16443 KCM_PORT=12257 SCHEDULER_PORT=12259
KUBELET_PORT=10250 KUBELET_HEALTHZ_PORT=10248 PROXY_HEALTHZ_PORT=12256 PROXY_METRICS_PORT=12249
CGROUP_ROOT=disagg-node
GUARD_TABLE=disagg_node

NODE_DIR="${DISAGG_NODE_DIR:-$REPO/.cluster/node}"   # configuration, keys, logs, etcd, kubelet
RUN_DIR=/run/disagg-node                              # sockets, pids, netns, runc and CNI state
CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/disagg/node"
CONTAINERD_ROOT="$CACHE_DIR/containerd"               # imported images survive a teardown
KUBECONFIG_PATH="$NODE_DIR/kubeconfig"
SOCK="$RUN_DIR/containerd/containerd.sock"
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
         kernel.panic kernel.panic_on_oops vm.overcommit_memory vm.panic_on_oom
         net.ipv4.conf.all.route_localnet)

log() { printf '[node %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "$*"; exit 1; }

FACTOR="${DISAGG_TEST_TIME_FACTOR:-1}"
[[ "$FACTOR" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "DISAGG_TEST_TIME_FACTOR must be a number >= 1, not '$FACTOR'"
scaled() { awk -v s="$1" -v f="$FACTOR" 'BEGIN { if (f < 1) f = 1; printf "%d\n", s * f + 0.5 }'; }

# wait_for SECONDS WHAT COMMAND...: poll until COMMAND succeeds.
wait_for() {
  local limit what=$2 start=$SECONDS; limit=$(scaled "$1"); shift 2
  until "$@" >/dev/null 2>&1; do
    (( SECONDS - start < limit )) || die "$what not ready in ${limit}s (logs: $NODE_DIR/logs)"
    sleep 0.5
  done
}

bin_dir() {
  if [[ "${1:-}" == --no-build ]]; then "$REPO/hack/k8s/build.sh" --bin-dir; else "$HERE/build.sh" | tail -n 1; fi
}

kubectl() { "$BIN/kubectl" --kubeconfig "$KUBECONFIG_PATH" "$@"; }
ctr() { command ctr --address "$SOCK" --namespace k8s.io "$@"; }

# render FILE: a template of this directory with every @NAME@ replaced by $NAME.
render() {
  local out name
  out=$(<"$HERE/$1")
  for name in NODE_NAME BRIDGE NODE_IP POD_SUBNET POD_RANGE_START CLUSTER_CIDR SERVICE_CIDR DNS_IP \
              KUBELET_PORT KUBELET_HEALTHZ_PORT PROXY_HEALTHZ_PORT PROXY_METRICS_PORT CGROUP_ROOT \
              GUARD_TABLE NODE_DIR RUN_DIR CONTAINERD_ROOT PAUSE_IMAGE COREDNS_IMAGE; do
    out=${out//@$name@/${!name}}
  done
  printf '%s\n' "$out"
}

# start NAME COMMAND...: a daemon in its own session, its pid in $RUN_DIR/pids, its log in $NODE_DIR/logs.
start() {
  local name=$1; shift
  setsid "$@" >"$NODE_DIR/logs/$name.log" 2>&1 </dev/null 8>&- &
  echo $! >"$RUN_DIR/pids/$name"
}

# stop NAME: TERM, then KILL after a grace period, the daemon start() recorded.
stop() {
  local file="$RUN_DIR/pids/$1" pid i
  [[ -f "$file" ]] || return 0
  pid=$(<"$file")
  if kill -TERM "$pid" 2>/dev/null; then
    for ((i = 0; i < 40; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

running() {
  [[ -f "$KUBECONFIG_PATH" && -x "${BIN:-}/kubectl" ]] || return 1
  kubectl get --raw /readyz >/dev/null 2>&1 &&
    [[ "$(kubectl get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

# --- keys and kubeconfigs --------------------------------------------------------------------------------

# cert NAME CN [ORG] [SANS]: an ECDSA key and a certificate signed by the node's CA.
cert() {
  local d="$NODE_DIR/pki" name=$1 cn=$2 org=${3:-} sans=${4:-}
  openssl req -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -keyout "$d/$name.key" \
    -subj "/CN=$cn${org:+/O=$org}" -out "$d/$name.csr" 2>/dev/null
  {
    echo "extendedKeyUsage=serverAuth,clientAuth"
    [[ -z "$sans" ]] || echo "subjectAltName=$sans"
  } >"$d/$name.ext"
  openssl x509 -req -in "$d/$name.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial -days 30 \
    -extfile "$d/$name.ext" -out "$d/$name.crt" 2>/dev/null
  rm -f "$d/$name.csr" "$d/$name.ext"
}

kubeconfig() {  # kubeconfig NAME: for the client certificate NAME
  cat >"$NODE_DIR/$1.kubeconfig" <<YAML
apiVersion: v1
kind: Config
clusters:
  - name: $NODE_NAME
    cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$NODE_DIR/pki/ca.crt"}
users:
  - name: $1
    user: {client-certificate: "$NODE_DIR/pki/$1.crt", client-key: "$NODE_DIR/pki/$1.key"}
contexts:
  - name: $NODE_NAME
    context: {cluster: $NODE_NAME, user: $1}
current-context: $NODE_NAME
YAML
}

write_pki() {
  local d="$NODE_DIR/pki" api_ip
  mkdir -p "$d"
  openssl req -x509 -new -nodes -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -days 30 \
    -subj "/CN=disagg-node-ca" -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
  api_ip="${SERVICE_CIDR%.*/*}.1"  # the first address of the Service range: the kubernetes Service
  cert apiserver kube-apiserver "" "IP:$NODE_IP,IP:$api_ip,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  cert kubelet-serving "system:node:$NODE_NAME" system:nodes "IP:$NODE_IP,DNS:$NODE_NAME"
  cert admin disagg-node-admin system:masters
  cert kubelet "system:node:$NODE_NAME" system:nodes
  cert kube-proxy system:kube-proxy
  cert kube-router system:kube-router
  cert controller-manager system:kube-controller-manager
  cert scheduler system:kube-scheduler
  openssl ecparam -name prime256v1 -genkey -noout -out "$d/sa.key"
  openssl ec -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  for name in admin kubelet kube-proxy kube-router controller-manager scheduler; do kubeconfig "$name"; done
  mv "$NODE_DIR/admin.kubeconfig" "$KUBECONFIG_PATH"
}

# --- the machine: what up adds and down removes ------------------------------------------------------------

save_host_state() {  # what down restores: sysctl values and which netfilter tables existed
  local s
  mkdir -p "$RUN_DIR/host"
  for s in "${SYSCTLS[@]}"; do
    [[ -e "/proc/sys/${s//.//}" ]] && echo "$s=$(sysctl -n "$s")"
  done >"$RUN_DIR/host/sysctl"
  nft list tables >"$RUN_DIR/host/nft-tables"
}

add_network() {
  ip link add "$BRIDGE" type bridge
  ip addr add "$NODE_IP/${POD_SUBNET#*/}" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  render guard.nft | nft -f -
  # kube-proxy's and kube-router's rules see traffic between pods on the bridge only through these (the
  # module is built into some kernels, this one's included; elsewhere it must be loaded first).
  [[ -e /proc/sys/net/bridge ]] || modprobe br_netfilter
  sysctl -qw net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
}

cgroup_dirs() {  # the node's cgroup in every v1 hierarchy (cgroup2 is mounted empty here)
  local m
  for m in /sys/fs/cgroup/*/; do
    [[ -f "$m/cgroup.procs" && "$(stat -f -c %T "$m")" == cgroupfs ]] && echo "${m%/}/$CGROUP_ROOT"
  done
  return 0
}

remove_cgroups() {
  local dir pid
  while read -r dir; do
    [[ -d "$dir" ]] || continue
    for pid in $(cat "$dir"/cgroup.procs "$dir"/*/cgroup.procs "$dir"/*/*/cgroup.procs "$dir"/*/*/*/cgroup.procs \
                   2>/dev/null | sort -u); do
      kill -KILL "$pid" 2>/dev/null || true
    done
    find "$dir" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done < <(cgroup_dirs)
}

unmount_under() {  # every mount point below the given directories, deepest first
  local prefix target
  for prefix in "$@"; do
    findmnt -rn -o TARGET | awk -v p="$prefix" 'index($0, p) == 1' | sort -r | while read -r target; do
      umount "$target" 2>/dev/null || umount -l "$target"
    done
  done
}

# Remove the chains of kube-proxy, kubelet, kube-router and the CNI plugins (KUBE-*, CNI-*) and every rule
# that jumps to them, from each table of iptables and ip6tables; then the tables down finds empty and that
# did not exist before up.
remove_iptables() {
  local tool table rule chain family
  for tool in iptables ip6tables; do
    for table in raw mangle nat filter security; do
      "$tool-save" -t "$table" >/dev/null 2>&1 || continue
      "$tool-save" -t "$table" | grep -E '^-A [^ ]+ .*-j (KUBE-|CNI-)' | grep -Ev '^-A (KUBE-|CNI-)' |
        while read -r rule; do eval "$tool -w -t $table -D ${rule#-A }" || true; done || true
      for chain in $("$tool-save" -t "$table" | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p'); do
        "$tool" -w -t "$table" -F "$chain" || true
      done
      for chain in $("$tool-save" -t "$table" | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p'); do
        "$tool" -w -t "$table" -X "$chain" || true
      done
      empty_table "$tool" "$table" || continue
      family=ip; [[ "$tool" == ip6tables ]] && family=ip6
      grep -qx "table $family $table" "$RUN_DIR/host/nft-tables" 2>/dev/null ||
        nft delete table "$family" "$table" 2>/dev/null || true
    done
  done
}

# empty_table TOOL TABLE: the table exists and holds no rule and no chain of its own.
empty_table() {
  local dump
  dump=$("$1-save" -t "$2" 2>/dev/null) && [[ -n "$dump" ]] || return 1
  ! grep -q '^-A ' <<<"$dump" && ! grep -Eq '^:' < <(grep -Ev '^:(PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) ' <<<"$dump")
}

remove_ipsets() {  # kube-router's (its --cleanup-config removes them; these are what a crash left)
  local set
  for set in $(ipset list -n 2>/dev/null | grep -E '^(KUBE-|kube-router-|inet6:KUBE-|TMP-)' || true); do
    ipset destroy "$set" 2>/dev/null || true
  done
}

restore_sysctls() {
  [[ -f "$RUN_DIR/host/sysctl" ]] || return 0
  local line
  while read -r line; do sysctl -qw "$line" || true; done <"$RUN_DIR/host/sysctl"
}

# --- the control plane and the node ----------------------------------------------------------------------

start_control_plane() {
  local pki="$NODE_DIR/pki"
  start etcd "$BIN/etcd" --name "$NODE_NAME" --data-dir "$NODE_DIR/etcd" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "$NODE_NAME=http://127.0.0.1:$ETCD_PEER_PORT"
  start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$API_PORT" \
    --tls-cert-file "$pki/apiserver.crt" --tls-private-key-file "$pki/apiserver.key" --client-ca-file "$pki/ca.crt" \
    --kubelet-client-certificate "$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$pki/apiserver-kubelet-client.key" \
    --kubelet-certificate-authority "$pki/ca.crt" --kubelet-preferred-address-types InternalIP \
    --service-account-key-file "$pki/sa.pub" --service-account-signing-key-file "$pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-cluster-ip-range "$SERVICE_CIDR" --service-node-port-range 30000-32767 \
    --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction --allow-privileged=true \
    --profiling=false
  wait_for 60 kube-apiserver kubectl get --raw /readyz
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$NODE_DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$NODE_DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$NODE_DIR/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$KCM_PORT" --leader-elect=false \
    --use-service-account-credentials --service-account-private-key-file "$pki/sa.key" \
    --root-ca-file "$pki/ca.crt" --cluster-signing-cert-file "$pki/ca.crt" --cluster-signing-key-file "$pki/ca.key" \
    --allocate-node-cidrs --cluster-cidr "$CLUSTER_CIDR" --node-cidr-mask-size 24 \
    --service-cluster-ip-range "$SERVICE_CIDR" --profiling=false
  start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$NODE_DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig "$NODE_DIR/scheduler.kubeconfig" \
    --authorization-kubeconfig "$NODE_DIR/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --leader-elect=false --profiling=false
}

start_containerd() {
  mkdir -p "$CONTAINERD_ROOT" "$RUN_DIR/cni" "$NODE_DIR/cni"
  render containerd.toml >"$NODE_DIR/containerd.toml"
  render cni.conflist >"$NODE_DIR/cni/10-disagg-node.conflist"
  start containerd containerd --config "$NODE_DIR/containerd.toml"
  wait_for 30 containerd ctr version
}

# import IMAGE...: copy images from buildah's storage into containerd, once per buildah image ID, sending only
# the layers containerd lacks (hack/node/oci_import.py): buildah pushes into an OCI layout whose blobs are hard
# links to containerd's own, so it copies only new layers (a code change: megabytes, not the worker's 7 GB),
# and the tar streamed to `ctr images import` leaves out every blob containerd already holds.
import_images() {
  local name id stamp start layout old ref
  mkdir -p "$CACHE_DIR/imported" "$CACHE_DIR/oci"
  for name in "$@"; do
    id=$(buildah inspect --type image --format '{{.FromImageID}}' "$name") || die "no image $name in buildah's storage"
    stamp="$CACHE_DIR/imported/$(tr '/:' '__' <<<"$name")"
    if [[ -f "$stamp" && "$(<"$stamp")" == "$id" ]] && ctr images ls -q | grep -qxF "$name"; then continue; fi
    log "importing $name into containerd"
    start=$SECONDS
    layout="$CACHE_DIR/oci/$(tr '/:' '__' <<<"$name")"
    old=$(ctr images ls "name==$name" | awk 'NR == 2 {print $3}')  # the manifest the name points at now
    buildah push --quiet --disable-compression "$name" "oci:$layout:$name" >/dev/null
    # shellcheck disable=SC2046  # one argument per digest
    python3 "$HERE/oci_import.py" tar "$layout" $(ctr content ls -q) | ctr images import - >/dev/null
    # A blob listed as present may have been collected since (content no image holds any more): then send all.
    if ! ctr images check "name==$name" | grep -qw complete; then  # not "incomplete"
      log "$name incomplete in containerd: sending every layer"
      python3 "$HERE/oci_import.py" tar "$layout" | ctr images import - >/dev/null
    fi
    python3 "$HERE/oci_import.py" link "$layout" "$CONTAINERD_ROOT/io.containerd.content.v1.content"
    # The CRI names every image it ran by its ID too: the replaced image's ID names go, and containerd frees
    # what only they held (7 GB for a worker image whose dependencies changed) once no container uses it.
    for ref in $(ctr images ls | awk -v old="$old" 'NR > 1 && $1 ~ /^sha256:/ && $3 == old {print $1}'); do
      ctr images rm "$ref" >/dev/null
    done
    echo "$id" >"$stamp"
    log "imported $name in $((SECONDS - start))s"
  done
}

start_node() {
  local d
  mkdir -p "$NODE_DIR/kubelet"
  : >"$NODE_DIR/resolv.conf"  # pods with dnsPolicy Default get no name server: nothing outside answers
  while read -r d; do mkdir -p "$d"; done < <(cgroup_dirs)
  render kubelet.yaml >"$NODE_DIR/kubelet.yaml"
  start kubelet "$BIN/kubelet" --config "$NODE_DIR/kubelet.yaml" --kubeconfig "$NODE_DIR/kubelet.kubeconfig" \
    --root-dir "$NODE_DIR/kubelet" --cert-dir "$NODE_DIR/kubelet/pki" \
    --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --node-labels disagg.local/real-node=true
  wait_for 120 "node $NODE_NAME" kubectl wait --for=condition=Ready "node/$NODE_NAME" --timeout=1s
  render kube-proxy.yaml >"$NODE_DIR/kube-proxy.yaml"
  start kube-proxy "$BIN/kube-proxy" --config "$NODE_DIR/kube-proxy.yaml"
  kubectl apply -f "$HERE/kube-router-rbac.yaml" >/dev/null
  start kube-router "$BIN/kube-router" --kubeconfig "$NODE_DIR/kube-router.kubeconfig" \
    --hostname-override "$NODE_NAME" --run-firewall=true --run-router=false --run-service-proxy=false \
    --service-cluster-ip-range "$SERVICE_CIDR" --health-port 0 --metrics-port 0 --enable-ipv6=false
  wait_for 60 "the default ServiceAccount" kubectl get serviceaccount default
  render coredns.yaml | kubectl apply -f - >/dev/null
  wait_for 120 CoreDNS kubectl -n kube-system wait --for=condition=Available deployment/coredns --timeout=1s
  lws up "$KUBECONFIG_PATH"
}

# The LeaderWorkerSet controller beside this control plane (hack/k8s/lws.sh), on ports from ones of its own so that
# it never meets the kwok cluster's (lws.sh moves up past ports already taken).
lws() { DISAGG_CLUSTER_DIR="$NODE_DIR" LWS_WEBHOOK_PORT=19444 LWS_HEALTH_PORT=18082 "$REPO/hack/k8s/lws.sh" "$@"; }

up() {
  BIN="$(bin_dir "$@")"
  if running; then
    log "reusing running node $NODE_NAME"
    lws up "$KUBECONFIG_PATH"
    echo "$KUBECONFIG_PATH"
    return
  fi
  local start_s=$SECONDS
  down_locked  # whatever a stopped or crashed node left
  mkdir -p "$NODE_DIR/logs" "$RUN_DIR/pids"
  save_host_state
  write_pki
  add_network
  start_control_plane
  start_containerd
  import_images "$PAUSE_IMAGE" "$COREDNS_IMAGE"
  start_node
  log "node $NODE_NAME ready in $((SECONDS - start_s))s"
  echo "$KUBECONFIG_PATH"
}

stop_containers() {  # kill every container and sandbox, so that no shim outlives containerd
  [[ -S "$SOCK" ]] || return 0
  local id
  for id in $(ctr tasks ls -q 2>/dev/null); do ctr tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  for id in $(ctr tasks ls -q 2>/dev/null); do ctr tasks delete -f "$id" >/dev/null 2>&1 || true; done
  for id in $(ctr containers ls -q 2>/dev/null); do ctr containers delete "$id" >/dev/null 2>&1 || true; done
}

kill_shims() {  # shims are started by containerd and reparented; each names our socket on its command line
  local pid
  for pid in $(ps -eo pid=,args= | awk -v s="-address $SOCK" 'index($0, s) {print $1}'); do
    kill -KILL "$pid" 2>/dev/null || true
  done
}

down_locked() {
  BIN="${BIN:-$(bin_dir --no-build)}"
  stop kube-router
  [[ -x "$BIN/kube-router" ]] && "$BIN/kube-router" --cleanup-config >/dev/null 2>&1 || true
  stop kube-proxy
  [[ -x "$BIN/kube-proxy" ]] && "$BIN/kube-proxy" --cleanup >/dev/null 2>&1 || true
  stop kubelet
  stop_containers
  stop containerd
  kill_shims
  lws down
  for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do stop "$name"; done
  remove_cgroups
  unmount_under "$RUN_DIR" "$NODE_DIR" "$CONTAINERD_ROOT"
  ip link del "$BRIDGE" 2>/dev/null || true
  nft delete table inet "$GUARD_TABLE" 2>/dev/null || true
  remove_iptables
  remove_ipsets
  conntrack -D -s "$CLUSTER_CIDR" >/dev/null 2>&1 || true
  conntrack -D -d "$CLUSTER_CIDR" >/dev/null 2>&1 || true
  restore_sysctls
  rm -rf "$RUN_DIR" "$NODE_DIR"
  rmdir "$(dirname "$NODE_DIR")" 2>/dev/null || true
}

down() {
  down_locked
  log "node $NODE_NAME removed"
}

[[ $EUID == 0 ]] || die "the node needs root (network, mounts, cgroups)"
mkdir -p "$CACHE_DIR"
exec 8>"$CACHE_DIR/.lock"  # one node per machine: up and down never overlap
flock 8

case "${1:-}" in
  up) shift; up "$@" ;;
  down) down ;;
  status) BIN="$(bin_dir --no-build)"; running ;;
  import) shift; import_images "$@" ;;
  tag) shift; ctr images tag --force "$1" "$2" >/dev/null ;;
  *) echo "usage: $0 up [--no-build]|down|status|import IMAGE...|tag IMAGE NEW-NAME" >&2; exit 2 ;;
esac
