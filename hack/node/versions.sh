# Versions and image names of the real node (sourced by build.sh and node.sh).
# kubelet and kube-proxy follow the control plane (K8S_VERSION, hack/k8s/build.sh).
K8S_VERSION="${K8S_VERSION:-v1.36.3}"
# The newest kube-router the Go module proxy serves (later tags answer 403 there).
KUBE_ROUTER_VERSION="${KUBE_ROUTER_VERSION:-v2.1.0}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.15.0}"
# The plugins linked into coredns: those hack/node/coredns.yaml's Corefile uses.
COREDNS_PLUGINS="errors log health ready kubernetes cache loadbalance reload"
# The pause version Kubernetes' own build/pause/Makefile tags.
PAUSE_VERSION="${PAUSE_VERSION:-3.10.2}"
PAUSE_IMAGE="localhost/disagg-node/pause:$PAUSE_VERSION"
COREDNS_IMAGE="localhost/disagg-node/coredns:$COREDNS_VERSION"
