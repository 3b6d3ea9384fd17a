"""The kvstore pod as the operator builds it (`spec.kvCache.store`) starts and is closed: its two containers'
commands, run as local processes with the pod's environment resolved (127.0.0.1 standing for the pod IP), bring up
mooncake_master and a mooncake_client whose segment is `store.memory`, both answer the /health their readiness
probes read, and every TCP port they listen on beyond the loopback is one the store's NetworkPolicy opens or a
probe's (the kubelet's, which NetworkPolicies do not filter)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from disagg_operator import names
from disagg_operator.builders import build_children
from disagg_operator.builders.ports import role_listeners
from disagg_operator.config import OperatorConfig
from disagg_operator.spec import ModelSpec
from tests.integration.procs import bindable, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SEGMENT = 64 * 2**20


def store_pod() -> tuple[ModelSpec, dict]:
    cr = yaml.safe_load((ROOT / "examples" / "dm-cpu-tcp.yaml").read_text())
    cr["metadata"].update(namespace="ns1", uid="uid-1")
    cr["spec"]["kvCache"] = {"store": {"memory": "64Mi"}}
    spec = ModelSpec.from_cr(cr)
    [deployment] = [
        c
        for c in build_children(spec, OperatorConfig())
        if c["metadata"]["name"] == "tiny-kvstore" and c["kind"] == "Deployment"
    ]
    return spec, deployment["spec"]["template"]["spec"]


def command(container: dict) -> tuple[list[str], dict[str, str]]:
    """The container's command line and environment as the kubelet would run them, on this machine."""
    env = {e["name"]: e.get("value", "127.0.0.1") for e in container.get("env", [])}  # POD_IP: the loopback
    args = [a.replace("$(POD_IP)", env.get("POD_IP", "")) for a in container["args"]]
    return [str(BIN / container["command"][0]), *args], env


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen]]:
    _, pod = store_pod()
    workdir = tmp_path_factory.mktemp("kvstore")
    procs: dict[str, subprocess.Popen] = {}
    # The pod's ports are fixed, and the master's (50051) lies in the kernel's ephemeral range, where any
    # outgoing connection of this machine may hold it for a while: the store starts once every one is free.
    fixed = [p["containerPort"] for c in pod["containers"] for p in c.get("ports", [])]
    wait_until(lambda: all(bindable(p, "0.0.0.0") for p in fixed), 120, what=f"the store's ports {fixed} free")
    try:
        for container in pod["containers"]:
            argv, env = command(container)
            log = open(workdir / f"{container['name']}.log", "w")
            procs[container["name"]] = subprocess.Popen(
                argv, env={"PATH": str(BIN), **env}, cwd=workdir, stdout=log, stderr=subprocess.STDOUT
            )
        for container in pod["containers"]:
            get = container["readinessProbe"]["httpGet"]
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == get["port"])
            url = f"http://127.0.0.1:{port}{get['path']}"
            wait_until(lambda url=url: _ok(url, procs), 60, what=container["name"])
        yield procs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(30)


def _ok(url: str, procs: dict[str, subprocess.Popen]) -> bool:
    assert all(p.poll() is None for p in procs.values()), {n: p.returncode for n, p in procs.items()}
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_the_store_holds_a_segment_of_the_stores_memory(launched):
    metrics = requests.get(f"http://127.0.0.1:{names.KVSTORE_ADMIN_PORT}/metrics", timeout=5).text
    assert f"master_total_capacity_bytes {SEGMENT}" in metrics


def test_the_store_listens_only_where_its_policy_and_its_probes_say(launched):
    spec, pod = store_pod()
    opened = [(ln.first, ln.last) for ln in role_listeners(spec, names.KVSTORE)]
    probes = {names.KVSTORE_ADMIN_PORT, names.KVSTORE_CLIENT_HTTP_PORT}
    listening = {
        (c.laddr.ip, c.laddr.port)
        for proc in launched.values()
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for c in p.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
    }
    outside = {port for ip, port in listening if not ip.startswith("127.")}
    stray = {port for port in outside if port not in probes and not any(a <= port <= b for a, b in opened)}
    assert stray == set(), sorted(listening)
    first, last = names.KVSTORE_TRANSFER_PORTS
    assert any(first <= port <= last for port in outside), sorted(listening)  # the transfer engine, in its window
    assert {names.KVSTORE_RPC_PORT, names.KVSTORE_METADATA_PORT} <= outside
