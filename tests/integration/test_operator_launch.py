"""The operator's output launches a working, closed stack.

Take the prefill, decode and router pods exactly as the operator's builders generate them for the CPU example
(with client API keys), give each "pod" its own loopback address (127.0.0.x stands for the pod IP; Service
names resolve to the pod behind them), resolve the downward-API environment, put each Secret volume's files
where the pod would see them, start the containers' commands as local processes, and check what a user and
the cluster would see: a completion through the router that matches the monolithic server; every TCP port a
process listens on is one the model's NetworkPolicy for that pod opens, and every connection between pods is
one it lets in; API keys on the router; decode contacts no host the router did not sign.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from disagg_operator.builders import build_children
from disagg_operator.builders.ports import role_listeners
from disagg_operator.config import OperatorConfig
from disagg_operator.names import REVISION_LABEL
from disagg_operator.observe import RoleObservation
from disagg_operator.probe_auth import health_token
from disagg_operator.prober import read_routers
from disagg_operator.routerview import (
    PairResult,
    handoff_condition,
    merge_reports,
    pairing_condition,
    transfer_status,
)
from disagg_operator.spec import ModelSpec
from disagg_worker.keys import WORKER, derive
from tests.integration.procs import scaled, serve, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dm-cpu-tcp.yaml"
POD_IPS = {"prefill": "127.0.0.12", "decode": "127.0.0.13", "router": "127.0.0.14"}
TOKEN = "launch-test-token"
REVISION = "rev-under-test"  # the pods' pairing-revision label, as the downward API would pass it
API_KEYS = ("client-key-1", "client-key-2")
SECRETS = {"tiny-auth": {"token": TOKEN}, "client-keys": {"api-key": "\n".join(API_KEYS) + "\n"}}


def the_cr() -> dict:
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"].update(namespace="default", uid="0000")
    cr["spec"]["apiKeySecret"] = {"name": "client-keys"}
    return cr


def children() -> list[dict]:
    return build_children(ModelSpec.from_cr(the_cr()), OperatorConfig())


def pods() -> dict[str, dict]:
    """The pod spec of each role, as the operator's workloads template it."""
    out = {}
    for child in children():
        if child["kind"] in ("StatefulSet", "Deployment"):
            out[child["metadata"]["labels"]["app.kubernetes.io/component"]] = child["spec"]["template"]["spec"]
    return out


def policies() -> dict[str, list[tuple[int, int, list[str] | None]]]:
    """Role -> the ingress its NetworkPolicy allows: (first port, last port, roles allowed in or None: anyone)."""
    out: dict[str, list[tuple[int, int, list[str] | None]]] = {}
    for child in children():
        if child["kind"] != "NetworkPolicy":
            continue
        role = child["spec"]["podSelector"]["matchLabels"]["disagg.dev/role"]
        rules = []
        for rule in child["spec"]["ingress"]:
            froms = rule.get("from")
            peers = None if froms is None else [f["podSelector"]["matchLabels"]["disagg.dev/role"] for f in froms]
            for port in rule["ports"]:
                rules.append((port["port"], port.get("endPort", port["port"]), peers))
        out[role] = rules
    return out


def allowed(policy: list[tuple[int, int, list[str] | None]], port: int, from_role: str) -> bool:
    return any(first <= port <= last and (peers is None or from_role in peers) for first, last, peers in policy)


def resolve_env(env: list[dict], pod_ip: str, pod_name: str) -> dict[str, str]:
    """What the kubelet would put in the environment: literal values and the downward API (no secrets)."""
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
        else:
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]  # a secretKeyRef fails here
    return out


def mount_secrets(pod: dict, root: Path) -> dict[str, str]:
    """Write each Secret volume's items under `root` as the kubelet would; returns mount path -> local dir."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    out = {}
    for m in pod["containers"][0]["volumeMounts"]:
        secret = volumes[m["name"]].get("secret")
        if secret is None:
            continue
        local = root / m["mountPath"].strip("/")
        local.mkdir(parents=True)
        for item in secret["items"]:
            (local / item["path"]).write_text(SECRETS[secret["secretName"]][item["key"]])
            (local / item["path"]).chmod(secret["defaultMode"])
        out[m["mountPath"]] = str(local)
    return out


def localize(args: list[str], env: dict[str, str], role: str, model: tuple[str, str], mounts: dict[str, str]):
    """Substitute addresses and paths: the pod IP for $(POD_IP) and 0.0.0.0, pod IPs for Service names, the
    local model directory and secret files for the pod's."""
    services = {f"tiny-{r}.default.svc.cluster.local": ip for r, ip in POD_IPS.items()}
    out = []
    for a in args:
        a = a.replace("$(POD_IP)", env["POD_IP"])
        a = POD_IPS[role] if a == "0.0.0.0" else a
        a = model[1] if a == model[0] else a
        for name, ip in services.items():
            a = a.replace(name, ip)
        for mount, local in mounts.items():
            a = a.replace(mount, local) if a.startswith(mount + "/") else a
        out.append(a)
    return out


@pytest.fixture(scope="module")
def launched(tiny_model, tmp_path_factory):
    built = pods()
    assert set(built) == {"prefill", "decode", "router"}
    args0 = built["prefill"]["containers"][0]["args"]
    model = (args0[args0.index("--model") + 1], tiny_model)
    procs = {}
    disagg = str(Path(sys.executable).with_name("disagg"))
    for role in ("prefill", "decode", "router"):
        c = built[role]["containers"][0]
        env = resolve_env(c.get("env", []), POD_IPS[role], f"tiny-{role}-0")
        mounts = mount_secrets(built[role], tmp_path_factory.mktemp(role))
        args = localize(c["args"], env, role, model, mounts)
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
        yield url, procs
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(scaled(20))
            except subprocess.TimeoutExpired:
                p.kill()


def _healthy(url: str, procs: dict) -> bool:
    dead = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
    assert not dead, f"exited: {dead}; see /tmp/disagg-launch-*.log"
    try:
        return requests.get(f"{url}/health", timeout=scaled(2)).status_code == 200
    except requests.RequestException:
        return False


BODY = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
KEY = {"Authorization": f"Bearer {API_KEYS[1]}"}


def complete(url: str, body: dict = BODY) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, headers=KEY, timeout=scaled(60))


def test_generated_commands_serve_a_completion(launched, tiny_model):
    url, _ = launched
    r = complete(url)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["text"]
    mono = serve(tiny_model, "--served-model-name", "tiny-llama").wait_healthy()
    try:
        want = requests.post(f"{mono.url}/v1/completions", json=BODY, timeout=scaled(60)).json()["choices"][0]["text"]
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

    operator = {"uid": health_token(TOKEN)}

    def view(tokens: dict[str, str] | None = None):
        # With API keys on the router (the CR's apiKeySecret), the details are for the operator's key.
        tokens = operator if tokens is None else tokens
        targets = {"uid": {"tiny-router-0": POD_IPS["router"]}}
        return merge_reports(asyncio.run(read_routers(targets, scaled(5.0), tokens))["uid"])

    def both_workers_read():
        # The router reads each worker's /health on its own schedule: one may be in its report before the other.
        v = view()
        return v if len(v.workers) >= 2 else None

    seen = wait_until(both_workers_read, timeout=30, what="handoff counters of both workers")
    # With the pairing revision both pods report (their label, through the downward API).
    assert seen.pairs == (PairResult("tiny-prefill-0", "tiny-decode-0", True, "", REVISION),)
    assert pairing_condition(spec, RoleObservation(1, 1, 1), seen) == (
        "True",
        "PairsVerified",
        "all 1 prefill->decode pairs verified",
    )
    assert handoff_condition(seen)[:2] == ("False", "Flowing")
    assert transfer_status(seen)["decode"] == {"bootstrapFailures": 0, "transferFailures": 0}
    assert sorted(w.pod for w in seen.workers) == ["tiny-decode-0", "tiny-prefill-0"]
    anonymous = view({})
    assert anonymous.reached == 1 and not anonymous.workers and not anonymous.pairs  # the status alone
    unreachable = merge_reports(asyncio.run(read_routers({"uid": {"tiny-router-1": "127.0.0.99"}}, 1.0))["uid"])
    assert unreachable.reached == 0 and pairing_condition(spec, RoleObservation(1, 0, 1), unreachable)[0] == "Unknown"


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    p = psutil.Process(proc.pid)
    return [p, *p.children(recursive=True)]


def listening(procs: dict) -> dict[str, set[int]]:
    """Role -> every TCP port a process of that pod listens on (IPv4 and IPv6)."""
    out: dict[str, set[int]] = {}
    for role, proc in procs.items():
        out[role] = {
            c.laddr.port for p in tree(proc) for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN
        }
    return out


def connections(procs: dict) -> set[tuple[str, str, int]]:
    """(role, peer role, peer port) of every established TCP connection from a pod's process to another pod now."""
    by_ip = {ip: role for role, ip in POD_IPS.items()}
    out = set()
    for role, proc in procs.items():
        for p in tree(proc):
            for c in p.net_connections("tcp"):
                if c.status != psutil.CONN_ESTABLISHED or not c.raddr:
                    continue
                peer = by_ip.get(c.raddr.ip.removeprefix("::ffff:"))
                if peer is not None and peer != role:
                    out.add((role, peer, c.raddr.port))
    return out


def flows(seen: set[tuple[str, str, int]], ports: dict[str, set[int]]) -> set[tuple[str, str, int]]:
    """(client role, server role, server port): the connections whose peer port is one its pod listens on."""
    return {(client, server, port) for client, server, port in seen if port in ports[server]}


NEEDED = [
    ("router", "prefill", "http"),
    ("router", "decode", "http"),
    ("decode", "prefill", "control"),
    ("prefill", "decode", "control"),
    ("prefill", "decode", "transfer"),
]


def test_every_listening_port_is_one_the_network_policy_opens_and_every_connection_one_it_lets_in(launched):
    url, procs = launched
    seen: set[tuple[str, str, int]] = set()
    lock = threading.Lock()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                now = connections(procs)
            except psutil.Error:
                now = set()
            with lock:
                seen.update(now)
            time.sleep(0.01)

    def seen_so_far() -> set[tuple[str, str, int]]:
        with lock:
            return set(seen)

    requests_sent = 0

    def every_needed_connection_seen() -> bool:
        # A connection may last only as long as one transfer, and the watcher samples: serve requests until it
        # caught every kind of connection a request makes (three on a quiet machine).
        nonlocal requests_sent
        body = {**BODY, "prompt": "Once upon a time " * (20 * (requests_sent % 3) + 1)}
        assert complete(url, body).status_code == 200
        requests_sent += 1
        # Mooncake's engines listen once they started: the listening ports are read again each time.
        return requests_sent >= 3 and set(NEEDED) <= kinds_of(flows(seen_so_far(), listening(procs)))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        try:
            wait_until(every_needed_connection_seen, timeout=60, interval=0, what="every kind of connection seen")
        except TimeoutError:
            pass  # the assertion below names what was never seen
    finally:
        stop.set()
        watcher.join()
    ports = listening(procs)
    policy = policies()
    for role, opened in ports.items():
        closed = sorted(p for p in opened if not any(first <= p <= last for first, last, _ in policy[role]))
        assert not closed, f"{role} listens on {closed}, which its NetworkPolicy does not open"
        unused = [(first, last) for first, last, _ in policy[role] if not any(first <= p <= last for p in opened)]
        assert not unused, f"{role}'s NetworkPolicy opens {unused}, where nothing listens"
    between = flows(seen, ports)
    refused = sorted(f for f in between if not allowed(policy[f[1]], f[2], f[0]))
    assert not refused, f"connections the NetworkPolicy would refuse: {refused}"
    kinds = kinds_of(between)
    for needed in NEEDED:
        assert needed in kinds, f"never saw {needed} in {requests_sent} requests; saw {sorted(between)}"


def listener_name(role: str, port: int) -> str:
    """What a port of a role's pod is for (http, bootstrap, control, transfer), as the operator says."""
    spec = ModelSpec.from_cr(the_cr())
    return next((x.name for x in role_listeners(spec, role) if x.first <= port <= x.last), "none")


def kinds_of(between: set[tuple[str, str, int]]) -> set[tuple[str, str, str]]:
    """(client role, server role, what the server's port is for) of each connection."""
    return {(client, server, listener_name(server, port)) for client, server, port in between}


def test_the_router_wants_an_api_key_and_answers_401_in_openais_shape(launched):
    url, _ = launched
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEYS[0]}):
        r = requests.post(f"{url}/v1/completions", json=BODY, headers=headers, timeout=scaled(30))
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key" and error["message"]
        assert requests.get(f"{url}/v1/models", headers=headers, timeout=scaled(30)).status_code == 401
    assert requests.get(f"{url}/health", timeout=scaled(30)).status_code == 200
    for key in API_KEYS:  # every key of the file is accepted
        r = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=scaled(30))
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny-llama"


def test_workers_take_only_the_routers_calls(launched):
    """A worker's HTTP port wants the router's token: a client key is not enough."""
    for role in ("prefill", "decode"):
        worker = f"http://{POD_IPS[role]}:8000"
        assert requests.get(f"{worker}/health", timeout=scaled(30)).status_code == 200
        for headers in ({}, KEY):
            assert requests.get(f"{worker}/stats", headers=headers, timeout=scaled(30)).status_code == 401
        router_token = {"Authorization": f"Bearer {derive(TOKEN, WORKER)}"}
        assert requests.get(f"{worker}/stats", headers=router_token, timeout=scaled(30)).status_code == 200


def test_decode_refuses_a_foreign_bootstrap_host_and_never_contacts_it(launched):
    url, _ = launched
    foreign = socket.create_server(("127.0.0.66", 0))
    foreign.setblocking(False)
    try:
        host, port = foreign.getsockname()
        router_token = {"Authorization": f"Bearer {derive(TOKEN, WORKER)}"}  # even a caller holding it
        decode = f"http://{POD_IPS['decode']}:8000"
        for sig in ({}, {"bootstrap_sig": "0" * 64}):
            body = {**BODY, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": 12345, **sig}
            r = requests.post(f"{decode}/v1/completions", json=body, headers=router_token, timeout=scaled(30))
            assert r.status_code == 403 and "not signed" in r.json()["error"]["message"], r.text
        assert complete(url).status_code == 200  # a full request through decode after the refusals
        with pytest.raises(BlockingIOError):
            foreign.accept()  # nothing ever connected to the foreign host
    finally:
        foreign.close()
