"""End-to-end tier: a real node (kubelet, containerd, runc, kube-proxy, CoreDNS, kube-router's network
policy controller) beside a control plane of its own, all on this machine (``hack/node/node.sh``,
``hack/node/README-node.md``). Pods run for real, from images imported into the node's containerd; nothing
is pulled and no traffic leaves the machine.

The session fixture ``real_node`` builds what is missing (a stamp check once built), starts the node and
removes it at the end. With ``DISAGG_REUSE_NODE=1``, or when a node is already running (``make
cluster-node``), it uses that node and leaves it running. The node changes the machine's network,
mounts and cgroups, so this tier needs root; without it the tests are skipped with that reason.

Every test under ``tests/e2e`` is marked ``e2e``.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.timing import scaled, wait_until

REPO = Path(__file__).resolve().parents[2]
NODE_SH = REPO / "hack" / "node" / "node.sh"
HERE = Path(__file__).resolve().parent
REUSE = os.environ.get("DISAGG_REUSE_NODE", "") == "1"
NODE_NAME = "disagg-node"
OPERATOR_IMAGE = "ghcr.io/disagg/operator:0.1.0"

_BUILD_ERRORS: list[str] = []


@dataclass(frozen=True)
class RealNode:
    """The running node's control plane: its kubeconfig and the binaries built for it."""

    kubeconfig: Path
    bin_dir: Path
    name: str = NODE_NAME

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        """Run the kubectl built for this control plane; raises on failure when ``check``."""
        proc = subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=scaled(timeout),
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def get(self, *args: str) -> dict:
        """``kubectl get ... -o json`` as a dict."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)


def _script(path: str, *args: str) -> str:
    """Run a script of hack/ and return the last line it printed; raises when it fails."""
    proc = subprocess.run([str(REPO / "hack" / path), *args], stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/{path} {' '.join(args)} failed with exit code {proc.returncode}")
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _node_running() -> bool:
    return subprocess.run([str(NODE_SH), "status"], capture_output=True).returncode == 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the node's binaries and images before any test runs, outside the per-test timeout."""
    if session.config.option.collectonly or os.geteuid() != 0:
        return
    if not any(item.get_closest_marker("e2e") for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show the build's progress live
        try:
            _script("node/build.sh")
        except RuntimeError as e:  # the e2e tests fail with it; the other tiers still run
            _BUILD_ERRORS.append(str(e))


@pytest.fixture(scope="session")
def real_node() -> Iterator[RealNode]:
    if os.geteuid() != 0:
        pytest.skip("the real node needs root: it adds a bridge, netfilter rules, mounts and cgroups")
    if _BUILD_ERRORS:
        pytest.fail(_BUILD_ERRORS[0], pytrace=False)
    bin_dir = Path(_script("k8s/build.sh", "--bin-dir"))
    owned = not REUSE and not _node_running()
    try:
        kubeconfig = Path(_script("node/node.sh", "up", "--no-build"))
        yield RealNode(kubeconfig=kubeconfig, bin_dir=bin_dir)
    finally:
        if owned:
            subprocess.run([str(NODE_SH), "down"], check=False)


@pytest.fixture(scope="session")
def operator_image(real_node: RealNode) -> str:
    """The operator image, built from this tree with buildah (its layer cache makes an unchanged tree a matter
    of seconds: an image only checked for presence ran stale code) and imported into the node's containerd."""
    _script("images/build.sh", "operator")
    _script("node/node.sh", "import", OPERATOR_IMAGE)
    return OPERATOR_IMAGE


@pytest.fixture
def namespace(real_node: RealNode) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    real_node.kubectl("create", "namespace", name)
    # Admission rejects pods until the controller-manager has created the namespace's default ServiceAccount.
    wait_until(
        lambda: real_node.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
        30,
        0.5,
        what=f"the default ServiceAccount of namespace {name}",
    )
    yield name
    real_node.kubectl("delete", "namespace", name, "--wait=false", check=False)
