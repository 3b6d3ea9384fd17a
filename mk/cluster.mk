# Local Kubernetes control plane built from source (see hack/k8s/README-testing.md).
#   make k8s-bin       build etcd, kube-apiserver, kube-controller-manager,
#                      kube-scheduler, kubectl, kwok, kwokctl and helm (cached)
#   make cluster       start the kwok cluster; kubeconfig in .cluster/kubeconfig
#   make cluster-down  delete it

K8S_VERSION ?= v1.36.3
K8S_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/disagg/k8s
K8S_BIN_DIR ?= $(K8S_CACHE_DIR)/$(K8S_VERSION)/bin
CLUSTER_KUBECONFIG ?= $(CURDIR)/.cluster/kubeconfig

export K8S_VERSION K8S_BIN_DIR
export DISAGG_K8S_CACHE := $(K8S_CACHE_DIR)

.PHONY: k8s-bin cluster cluster-down

k8s-bin:
	@$(call phase,k8s-bin) hack/k8s/build.sh >/dev/null

cluster: k8s-bin
	hack/k8s/cluster.sh up

cluster-down:
	hack/k8s/cluster.sh down
