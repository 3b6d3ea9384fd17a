# A real node beside a control plane of its own (see hack/node/README-node.md). Needs root.
#   make node-bin           build kubelet, kube-proxy, kube-router, CoreDNS, pause and their images (cached)
#   make cluster-node       start the node; kubeconfig in .cluster/node/kubeconfig
#   make cluster-node-down  stop it and remove everything it added to the machine

# Debian's packages the node runs: its container runtime, CNI plugins, kube-router's and teardown's tools, and
# the image builder (buildah, mmdebstrap) for the images its pods run.
NODE_PACKAGES := containerd runc containernetworking-plugins ipset conntrack nftables buildah mmdebstrap

.PHONY: node-packages node-bin cluster-node cluster-node-down

# A machine with Docker's containerd.io (which ships containerd and runc) keeps it: Debian's containerd and runc
# conflict with it, and apt would remove Docker to install them.
NODE_PACKAGES_WANTED := $(if $(shell dpkg -s containerd.io >/dev/null 2>&1 && echo kept),\
	$(filter-out containerd runc,$(NODE_PACKAGES)),$(NODE_PACKAGES))

node-packages:
	@$(MAKE) --no-print-directory PACKAGES='$(NODE_PACKAGES_WANTED)' debian-packages

node-bin: node-packages
	@$(call phase,node-bin) nice hack/node/build.sh >/dev/null

cluster-node: node-bin
	hack/node/node.sh up --no-build

cluster-node-down:
	hack/node/node.sh down
