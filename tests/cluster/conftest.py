"""Cluster tier: tests against a real Kubernetes API server.

The control plane is etcd, kube-apiserver, kube-controller-manager and
kube-scheduler built from source by ``hack/k8s/build.sh`` and run as local
processes by ``hack/k8s/cluster.sh`` (kwokctl, binary runtime). kwok plays the
kubelets of fake GPU nodes, so pods requesting ``nvidia.com/gpu`` and
``rdma/ib`` schedule and become Ready.

Like envtest, a session starts its own cluster (``.cluster/pytest``) and deletes
it at the end. With ``DISAGG_REUSE_CLUSTER=1`` it uses the cluster of
``make cluster`` (``.cluster/kubeconfig``), starting it if needed, and leaves it
running, so repeated runs skip the start-up.

Every test under ``tests/cluster`` is marked ``cluster``;
``pytest -m "not cluster"`` skips them and never builds anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.timing import scaled, wait_until

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack" / "k8s"
HERE = Path(__file__).resolve().parent
REUSE = os.environ.get("DISAGG_REUSE_CLUSTER", "") == "1"

# kwok's chaos stage: a running pod carrying this label has its containers fail.
CHAOS_LABEL = "pod-container-running-failed.stage.kwok.x-k8s.io"

_BUILD_ERRORS: list[str] = []


@dataclass(frozen=True)
class KubeCluster:
    """A running control plane: its kubeconfig and the binaries built for it."""

    kubeconfig: Path
    bin_dir: Path
    _helm_home: Path = field(repr=False)

    @property
    def kubectl_path(self) -> Path:
        return self.bin_dir / "kubectl"

    @property
    def helm_path(self) -> Path:
        return self.bin_dir / "helm"

    @property
    def env(self) -> dict[str, str]:
        """Environment for tools and operators run against this cluster."""
        home = self._helm_home
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the kubectl built for this cluster; raises on failure when ``check``."""
        return self._run(self.kubectl_path, args, input, check)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._run(self.helm_path, args, None, check)

    def get(self, *args: str) -> dict:
        """``kubectl get ... -o json`` as a dict."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def fail_pod(self, namespace: str, name: str, *, reason: str = "Error", exit_code: int = 1) -> None:
        """Make the containers of a running pod terminate (kwok's chaos stage)."""
        prefix = f"{CHAOS_LABEL}/"
        self.kubectl(
            "-n",
            namespace,
            "annotate",
            "--overwrite",
            f"pod/{name}",
            f"{prefix}reason={reason}",
            f"{prefix}exit-code={exit_code}",
        )
        self.kubectl("-n", namespace, "label", "--overwrite", f"pod/{name}", f"{CHAOS_LABEL}=true")

    def api_client(self):
        """A python kubernetes ApiClient for this cluster."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def _run(
        self, tool: Path, args: tuple[str, ...], input: str | None, check: bool
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(tool), *args], input=input, env=self.env, capture_output=True, text=True, timeout=scaled(180)
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{tool.name} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc


def _cluster_env() -> dict[str, str]:
    if REUSE:
        return dict(os.environ)
    return {
        **os.environ,
        "DISAGG_CLUSTER_NAME": "disagg-pytest",
        "DISAGG_CLUSTER_DIR": str(REPO / ".cluster" / "pytest"),
    }


def _script(*args: str, env: dict[str, str]) -> str:
    proc = subprocess.run([str(HACK / args[0]), *args[1:]], env=env, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/k8s/{' '.join(args)} failed with exit code {proc.returncode}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.cluster)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the binaries before any test runs, outside the per-test timeout.

    A cold build takes many minutes; once built, this is a stamp check.
    """
    if session.config.option.collectonly:
        return
    if not any(item.get_closest_marker("cluster") for item in session.items):
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # show the build's progress live
        try:
            _script("build.sh", env=dict(os.environ))
        except RuntimeError as e:  # the cluster tests fail with it; the other tiers still run
            _BUILD_ERRORS.append(str(e))


@pytest.fixture(scope="session")
def k8s_bin_dir() -> Path:
    """The directory of the binaries built for this tier (kubectl, helm, ...), for tests that need no cluster."""
    if _BUILD_ERRORS:
        pytest.fail(_BUILD_ERRORS[0], pytrace=False)
    return Path(_script("build.sh", env=dict(os.environ)))


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    if _BUILD_ERRORS:
        pytest.fail(_BUILD_ERRORS[0], pytrace=False)
    env = _cluster_env()
    bin_dir = Path(_script("build.sh", env=env))
    try:
        kubeconfig = Path(_script("cluster.sh", "up", env=env))
        yield KubeCluster(kubeconfig=kubeconfig, bin_dir=bin_dir, _helm_home=tmp_path_factory.mktemp("helm"))
    finally:
        if not REUSE:
            subprocess.run([str(HACK / "cluster.sh"), "down"], env=env, check=False)


@pytest.fixture
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube_cluster.kubectl("create", "namespace", name)
    # Admission rejects pods until the controller-manager has created the
    # namespace's default ServiceAccount.
    wait_until(
        lambda: kube_cluster.kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0,
        30,
        0.5,
        what=f"the default ServiceAccount of namespace {name}",
    )
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
