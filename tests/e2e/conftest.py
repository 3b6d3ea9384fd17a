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
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e import readme
from tests.phases import record_phase
from tests.timing import scaled, wait_until

REPO = Path(__file__).resolve().parents[2]
NODE_SH = REPO / "hack" / "node" / "node.sh"
HERE = Path(__file__).resolve().parent
REUSE = os.environ.get("DISAGG_REUSE_NODE", "") == "1"
NODE_NAME = "disagg-node"
OPERATOR_IMAGE = "ghcr.io/disagg/operator:0.1.0"
WORKER_IMAGE = "ghcr.io/disagg/worker:0.1.0"
ENVOY_IMAGE = "localhost/disagg-e2e-envoy:1.40.0"  # hack/images/build.sh envoy: a gateway's data plane

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

    def tag(self, image: str, name: str) -> None:
        """Give an image in the node's containerd another name (a new image to the kubelet, nothing copied)."""
        _script("node/node.sh", "tag", image, name)


def _script(path: str, *args: str) -> str:
    """Run a script of hack/ and return the last line it printed; raises when it fails."""
    start = time.time()
    proc = subprocess.run([str(REPO / "hack" / path), *args], stdout=subprocess.PIPE, text=True)
    if path != "k8s/build.sh" or args != ("--bin-dir",):
        record_phase(f"e2e: {path} {' '.join(args)}".strip(), start, time.time() - start, proc.returncode)
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
    """Build the node's binaries and the images from this tree before any test runs, outside the per-test
    timeout. buildah's layer cache makes an unchanged tree a matter of seconds (an image only checked for
    presence would run stale code); the worker image is built only when a selected test runs it, the gateway's
    Envoy likewise."""
    if session.config.option.collectonly or os.geteuid() != 0:
        return
    e2e = [item for item in session.items if item.get_closest_marker("e2e")]
    if not e2e:
        return

    def wanted(fixture: str) -> bool:
        return any(fixture in getattr(item, "fixturenames", ()) for item in e2e)

    images = "all" if wanted("worker_image") else "operator"
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show the build's progress live
        try:
            _script("node/build.sh")
            _script("images/build.sh", images)
            if wanted("envoy_image"):
                _script("images/build.sh", "envoy")
        except RuntimeError as e:  # the e2e tests fail with it; the other tiers still run
            _BUILD_ERRORS.append(str(e))


_MEASURED: list[str] = []


@pytest.fixture(scope="session")
def report() -> Callable[[str], None]:
    """Note a measurement (how long something took on the real node); printed in pytest's summary."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _MEASURED:
        terminalreporter.section("measured on the real node")
        for line in _MEASURED:
            terminalreporter.write_line(line)


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
        node = RealNode(kubeconfig=kubeconfig, bin_dir=bin_dir)
        # What an interrupted session left on a reused node (its pods would hold the node's CPU) goes first.
        node.kubectl("delete", "namespace", "-l", E2E_LABEL, "--timeout=300s", timeout=330, check=False)
        yield node
    finally:
        if owned:
            subprocess.run([str(NODE_SH), "down"], check=False)


@pytest.fixture(scope="session")
def operator_image(real_node: RealNode) -> str:
    """The operator image built from this tree, imported into the node's containerd (never pulled)."""
    _script("node/node.sh", "import", OPERATOR_IMAGE)
    return OPERATOR_IMAGE


@pytest.fixture(scope="session")
def worker_image(real_node: RealNode, report: Callable[[str], None]) -> str:
    """The worker image built from this tree (torch and the demo model inside), imported into containerd."""
    start = time.monotonic()
    _script("node/node.sh", "import", WORKER_IMAGE)
    report(f"worker image in containerd {time.monotonic() - start:.0f}s after the import started")
    return WORKER_IMAGE


@pytest.fixture(scope="session")
def envoy_image(real_node: RealNode) -> str:
    """The gateway's Envoy (tests/e2e/Dockerfile.envoy), imported into containerd."""
    _script("node/node.sh", "import", ENVOY_IMAGE)
    return ENVOY_IMAGE


E2E_LABEL = "disagg.dev/e2e-test"  # on every namespace a test makes: a later session removes what one left


def new_namespace(node: RealNode, prefix: str) -> str:
    """A fresh namespace, labelled as the tier's; pods can be created in it at once."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    node.kubectl("create", "namespace", name)
    node.kubectl("label", "namespace", name, f"{E2E_LABEL}=true")
    # Admission rejects pods until the controller-manager has created the namespace's default ServiceAccount.
    wait_until(
        lambda: node.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
        30,
        0.5,
        what=f"the default ServiceAccount of namespace {name}",
    )
    return name


@pytest.fixture
def namespace(real_node: RealNode) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = new_namespace(real_node, "e2e")
    yield name
    real_node.kubectl("delete", "namespace", name, "--wait=false", check=False)


OPERATOR_NS = "disagg-system"
OPERATOR_RELEASE = "disagg-operator"


@pytest.fixture(scope="session")
def operator_release(
    real_node: RealNode, operator_image: str, tmp_path_factory: pytest.TempPathFactory, report: Callable[[str], None]
) -> Iterator[str]:
    """The chart installed by the README's `helm install` line (its release, chart and namespace), as `helm upgrade
    --install` so that a reused node takes it too, at the chart's HA setting (two replicas, one active): the
    operator runs as pods of the imported image, never pulled."""
    start = time.monotonic()
    home = tmp_path_factory.mktemp("helm")
    env = {
        **os.environ,
        "KUBECONFIG": str(real_node.kubeconfig),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    helm = str(real_node.bin_dir / "helm")
    repository, tag = operator_image.rsplit(":", 1)
    shown = readme.helm_install()
    assert shown[:2] == [OPERATOR_RELEASE, "charts/disagg-operator"], shown
    assert "--create-namespace" in shown and shown[shown.index("-n") + 1] == OPERATOR_NS, shown
    install = [helm, "upgrade", "--install", *shown, "--set", "replicas=2"]
    install += ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}"]
    install += ["--set", "image.pullPolicy=Never"]
    proc = subprocess.run(install, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(180))
    assert proc.returncode == 0, f"helm install failed:\n{proc.stdout}{proc.stderr}"
    # Helm installs CRDs only on a first install; on a reused node they follow the chart as
    # operator/README-operator.md says.
    real_node.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    real_node.kubectl("wait", "--for=condition=Established", "crd/disaggregatedmodels.disagg.dev", "--timeout=60s")
    if "REVISION: 1\n" not in proc.stdout:
        # A release left by an interrupted session on a reused node: an image rebuilt under the same name
        # changes nothing in the pod template, so the pods are restarted onto it.
        real_node.kubectl("-n", OPERATOR_NS, "rollout", "restart", f"deployment/{OPERATOR_RELEASE}")
    real_node.kubectl(
        "-n", OPERATOR_NS, "rollout", "status", f"deployment/{OPERATOR_RELEASE}", "--timeout=300s", timeout=330
    )
    report(f"operator Deployment (2 replicas) rolled out {time.monotonic() - start:.0f}s after helm install")
    yield OPERATOR_RELEASE
    subprocess.run([helm, "uninstall", OPERATOR_RELEASE, "--namespace", OPERATOR_NS, "--wait"], env=env, check=False)
