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
node-packages:
	@wanted="$(NODE_PACKAGES)"; if dpkg -s containerd.io >/dev/null 2>&1; then \
	  wanted=$$(tr ' ' '\n' <<<"$$wanted" | grep -vx -e containerd -e runc | tr '\n' ' '); fi; \
	missing=""; for p in $$wanted; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $$missing; fi

node-bin: node-packages
	nice hack/node/build.sh

cluster-node: node-bin
	hack/node/node.sh up --no-build

cluster-node-down:
	hack/node/node.sh down
