"""The operator's output launches a working stack.

Take the prefill, decode and router containers exactly as the operator's builders generate them for
the CPU example, give each "pod" its own loopback address (127.0.0.x stands for the pod IP; Service
names resolve to the pod behind them), resolve the downward-API and Secret environment, start them
as local processes, and get a completion through the router that matches the monolithic server.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml

from disagg_operator.builders import build_children
from disagg_operator.config import OperatorConfig
from disagg_operator.names import REVISION_LABEL
from disagg_operator.observe import RoleObservation
from disagg_operator.prober import read_routers
from disagg_operator.routerview import (
    PairResult,
    handoff_condition,
    merge_reports,
    pairing_condition,
    transfer_status,
)
from disagg_operator.spec import ModelSpec
from tests.integration.procs import serve, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dm-cpu-tcp.yaml"
POD_IPS = {"prefill": "127.0.0.12", "decode": "127.0.0.13", "router": "127.0.0.14"}
TOKEN = "launch-test-token"
REVISION = "rev-under-test"  # the pods' pairing-revision label, as the downward API would pass it


def containers(example: Path) -> dict[str, dict]:
    cr = yaml.safe_load(example.read_text())
    cr["metadata"].update(namespace="default", uid="0000")
    spec = ModelSpec.from_cr(cr)
    out = {}
    for child in build_children(spec, OperatorConfig()):
        if child["kind"] in ("StatefulSet", "Deployment"):
            role = child["metadata"]["labels"]["app.kubernetes.io/component"]
            out[role] = child["spec"]["template"]["spec"]["containers"][0]
    return out


def resolve_env(env: list[dict], pod_ip: str, pod_name: str) -> dict[str, str]:
    """What the kubelet would put in the environment: literal values, downward API, the Secret."""
    fields = {
        "status.podIP": pod_ip,
        "metadata.name": pod_name,
        "metadata.namespace": "default",
        f"metadata.labels['{REVISION_LABEL}']": REVISION,
    }
    out = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            out[e["name"]] = TOKEN
    return out


def localize(args: list[str], env: dict[str, str], role: str, model_dir: str, model_arg: str) -> list[str]:
    """Substitute addresses: the pod IP for $(POD_IP) and 0.0.0.0, pod IPs for Service names."""
    services = {f"tiny-{r}.default.svc.cluster.local": ip for r, ip in POD_IPS.items()}
    out = []
    for a in args:
        a = a.replace("$(POD_IP)", env["POD_IP"])
        a = POD_IPS[role] if a == "0.0.0.0" else a
        a = model_dir if a == model_arg else a
        for name, ip in services.items():
            a = a.replace(name, ip)
        out.append(a)
    return out


@pytest.fixture(scope="module")
def launched(tiny_model):
    built = containers(EXAMPLE)
    assert set(built) == {"prefill", "decode", "router"}
    model_arg = next(a for i, a in enumerate(built["prefill"]["args"]) if built["prefill"]["args"][i - 1] == "--model")
    procs = {}
    disagg = str(Path(sys.executable).with_name("disagg"))
    for role in ("prefill", "decode", "router"):
        c = built[role]
        env = resolve_env(c.get("env", []), POD_IPS[role], f"tiny-{role}-0")
        args = localize(c["args"], env, role, tiny_model, model_arg)
        assert c["command"] == ["disagg"]
        log = open(f"/tmp/disagg-launch-{role}.log", "w")
        procs[role] = subprocess.Popen(
            [disagg, *args],
            env={**os.environ, **env, "MC_LOG_LEVEL": "WARNING"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://{POD_IPS['router']}:8000"
    try:
        wait_until(lambda: _healthy(url, procs), timeout=180, interval=0.5, what="the launched stack healthy")
        yield url
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _healthy(url: str, procs: dict) -> bool:
    dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
    assert not dead, f"exited: {dead}; see /tmp/disagg-launch-*.log"
    try:
        return requests.get(f"{url}/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_generated_commands_serve_a_completion(launched, tiny_model):
    body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{launched}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["text"]
    mono = serve(tiny_model, "--served-model-name", "tiny-llama").wait_healthy()
    try:
        want = requests.post(f"{mono.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    finally:
        mono.stop()
    assert got == want
    assert r.json()["usage"]["completion_tokens"] == 8


def test_the_operator_reads_the_verified_path_from_the_launched_router(launched):
    """What the operator's prober gets from the router pod: the pair, named by the pods' names from the downward
    API, verified through a real handoff; handoff counters flowing (see disagg_operator.prober)."""
    spec = ModelSpec.from_cr(
        {**yaml.safe_load(EXAMPLE.read_text()), "metadata": {"name": "tiny", "namespace": "default"}}
    )

    def view():
        reports = asyncio.run(read_routers({"uid": {"tiny-router-0": POD_IPS["router"]}}, 5.0))["uid"]
        return merge_reports(reports)

    seen = wait_until(lambda: (lambda v: v if v.workers else None)(view()), timeout=30, what="handoff counters")
    assert seen.pairs == (PairResult("tiny-prefill-0", "tiny-decode-0", True, ""),)
    assert pairing_condition(spec, RoleObservation(1, 1, 1), seen) == (
        "True",
        "PairsVerified",
        "all 1 prefill->decode pairs verified",
    )
    assert handoff_condition(seen)[:2] == ("False", "Flowing")
    assert transfer_status(seen)["decode"] == {"bootstrapFailures": 0, "transferFailures": 0}
    assert sorted(w.pod for w in seen.workers) == ["tiny-decode-0", "tiny-prefill-0"]
    unreachable = merge_reports(asyncio.run(read_routers({"uid": {"tiny-router-1": "127.0.0.99"}}, 1.0))["uid"])
    assert unreachable.reached == 0 and pairing_condition(spec, RoleObservation(1, 0, 1), unreachable)[0] == "Unknown"
