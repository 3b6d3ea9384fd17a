"""What the e2e tests do with a DisaggregatedModel on the real node: apply one and wait until it and its pods are
Ready, reach its router (port-forward, or Service DNS from a pod), run streaming load from a pod, look at the
pods' own /stats and /metrics, and gather what a user reads when something does not come up."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import yaml

from disagg_operator.builders.secret import auth_token_file
from tests.e2e.conftest import OPERATOR_NS, OPERATOR_RELEASE, REPO, RealNode
from tests.timing import scaled, wait_until

EXAMPLE = REPO / "examples" / "dm-smollm2-cpu.yaml"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={OPERATOR_RELEASE}"
MODEL_LABEL = "disagg.dev/model"  # operator/disagg_operator/names.py
ROLE_LABEL = "disagg.dev/role"
QUESTION = "What is the capital of France?"
POLL_S = 1.0  # between polls that run kubectl: each starts a process, which a loaded 2-core machine feels
# Model loading, probes and the operator's first pairing check on a loaded 2-core machine.
MODEL_READY_S = 600


def diagnostics(node: RealNode, namespace: str) -> str:
    """What a user looks at when the model does not come up: the CR, events, pods described, their logs."""
    parts: list[str] = []
    for args in (
        ("get", "disaggregatedmodels,all,networkpolicies", "-o", "wide"),
        ("get", "disaggregatedmodels", "-o", "yaml"),
        ("describe", "pods"),
        ("get", "events", "--sort-by=.lastTimestamp"),
    ):
        proc = node.kubectl("-n", namespace, *args, check=False)
        parts.append(f"$ kubectl -n {namespace} {' '.join(args)}\n{proc.stdout}{proc.stderr}")
    for pod in node.kubectl("-n", namespace, "get", "pods", "-o", "name", check=False).stdout.split():
        proc = node.kubectl("-n", namespace, "logs", pod, "--all-containers", "--tail=60", check=False)
        parts.append(f"$ kubectl -n {namespace} logs {pod}\n{proc.stdout}{proc.stderr}")
    proc = node.kubectl("-n", OPERATOR_NS, "logs", "-l", OPERATOR_SELECTOR, "--tail=60", check=False)
    parts.append(f"$ kubectl -n {OPERATOR_NS} logs -l {OPERATOR_SELECTOR}\n{proc.stdout}{proc.stderr}")
    return "\n".join(parts)


def conditions(cr: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in cr.get("status", {}).get("conditions", [])}


def pod_ready(pod: dict) -> bool:
    conds = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return (
        pod["status"].get("phase") == "Running"
        and conds.get("Ready") == "True"
        and not pod["metadata"].get("deletionTimestamp")
    )


@dataclass(frozen=True)
class Model:
    """A DisaggregatedModel that is Ready, and how to reach it."""

    namespace: str
    name: str
    served_name: str
    endpoint: str  # status.endpoint: the router Service's URL inside the cluster
    router_service: str

    def pods(self, node: RealNode, role: str) -> list[dict]:
        """The role's pods that are not being deleted."""
        sel = f"{MODEL_LABEL}={self.name},{ROLE_LABEL}={role}"
        items = node.get("-n", self.namespace, "pods", "-l", sel)["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def example(namespace: str, **changes: object) -> dict:
    """The example as written, in `namespace`; the image is imported, never pulled."""
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"]["namespace"] = namespace
    cr["spec"]["imagePullPolicy"] = "Never"
    cr["spec"].update(changes)
    return cr


def model_ready(
    node: RealNode, namespace: str, name: str, decodes: int = 1, prefills: int = 1, stores: int = 0, epps: int = 0
) -> dict:
    """The CR once it is Ready and PairingVerified, for its current generation, with every pod Ready (`stores`:
    the kvstore pods of `spec.kvCache.store`, 0 or 1; `epps`: the endpoint picker's of `spec.gateway`); {} before."""
    obj = node.get("-n", namespace, f"disaggregatedmodels/{name}")
    conds = conditions(obj)
    if conds.get("Ready") != "True" or conds.get("PairingVerified") != "True":
        return {}
    if obj.get("status", {}).get("observedGeneration") != obj["metadata"]["generation"]:
        return {}
    pods = node.get("-n", namespace, "pods", "-l", f"{MODEL_LABEL}={name}")["items"]
    roles = [p["metadata"]["labels"].get(ROLE_LABEL) for p in pods]
    wanted = ["router", *["prefill"] * prefills, *["decode"] * decodes, *["kvstore"] * stores, *["epp"] * epps]
    if sorted(roles) != sorted(wanted):
        return {}
    return obj if all(pod_ready(p) for p in pods) else {}


def apply_model(
    node: RealNode,
    cr: dict,
    decodes: int = 1,
    prefills: int = 1,
    apply: Callable[[], object] | None = None,
    stores: int = 0,
    epps: int = 0,
) -> Model:
    """`kubectl apply` the CR (or call `apply`, which applies it) and wait until it is Ready with every pod Ready."""
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    if apply is None:
        node.kubectl("apply", "-f", "-", input=json.dumps(cr))
    else:
        apply()
    try:
        obj = wait_until(
            lambda: model_ready(node, namespace, name, decodes, prefills, stores, epps),
            MODEL_READY_S,
            2 * POLL_S,
            what=f"DisaggregatedModel {name} Ready and paired",
        )
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{diagnostics(node, namespace)}") from None
    routers = node.get("-n", namespace, "services", "-l", f"{MODEL_LABEL}={name},{ROLE_LABEL}=router")["items"]
    assert len(routers) == 1, [s["metadata"]["name"] for s in routers]
    return Model(
        namespace=namespace,
        name=name,
        served_name=cr["spec"].get("servedModelName", name),
        endpoint=obj["status"]["endpoint"],
        router_service=routers[0]["metadata"]["name"],
    )


@contextlib.contextmanager
def served(
    node: RealNode,
    cr: dict,
    client_image: str,
    report: Callable[[str], None],
    what: str,
    decodes: int = 1,
    prefills: int = 1,
    apply: Callable[[], object] | None = None,
    stores: int = 0,
    epps: int = 0,
) -> Iterator[Model]:
    """The CR applied (by `apply` if given) and Ready, with a client pod beside it; the time to Ready reported as
    `what`; the CR and its namespace deleted afterwards."""
    try:
        start = time.monotonic()
        model = apply_model(node, cr, decodes, prefills, apply, stores, epps)
        report(f"{what} Ready and PairingVerified {time.monotonic() - start:.0f}s after apply")
        client_pod(node, model.namespace, client_image)
        yield model
    finally:
        delete_model(node, cr["metadata"]["namespace"])


def delete_model(node: RealNode, namespace: str) -> None:
    """The CR first, while the operator still runs (its finalizer), then the namespace."""
    node.kubectl("-n", namespace, "delete", "disaggregatedmodels", "--all", "--timeout=120s", check=False)
    node.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def client_pod(node: RealNode, namespace: str, image: str) -> str:
    """A pod without the model's labels, with python3 (the operator image); it sends requests from inside."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client", "namespace": namespace, "labels": {"app": "e2e-client"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
            "containers": [
                {"name": "client", "image": image, "imagePullPolicy": "Never", "command": ["sleep", "infinity"]}
            ],
        },
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(pod))
    node.kubectl("-n", namespace, "wait", "--for=condition=Ready", "pod/client", "--timeout=120s", timeout=150)
    return "client"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def port_forward(node: RealNode, namespace: str, service: str, port: int) -> Iterator[str]:
    """`kubectl port-forward svc/...` to a free local port; yields the local base URL."""
    local = free_port()
    proc = subprocess.Popen(
        [str(node.bin_dir / "kubectl"), "--kubeconfig", str(node.kubeconfig), "-n", namespace]
        + ["port-forward", f"svc/{service}", f"{local}:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def listening() -> bool:
            assert proc.poll() is None, f"kubectl port-forward exited: {proc.communicate()[1]}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", local), timeout=1):
                return True
            return False

        wait_until(listening, 30, 0.2, what="kubectl port-forward listening")
        yield f"http://127.0.0.1:{local}"
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(10))


# Run in the client pod: one chat request to the router by its Service name (with an API key when a fifth
# argument gives one); prints the JSON reply (an error answer's status and body to stderr, so that a failure shows
# what the router said).
CHAT = """
import json, sys, urllib.error, urllib.request
body = {"model": sys.argv[2], "messages": [{"role": "user", "content": sys.argv[3]}],
        "temperature": 0, "max_tokens": 32}
headers = {"Content-Type": "application/json"}
if len(sys.argv) > 5:
    headers["Authorization"] = "Bearer " + sys.argv[5]
req = urllib.request.Request(sys.argv[1] + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
try:
    print(urllib.request.urlopen(req, timeout=float(sys.argv[4])).read().decode())
except urllib.error.HTTPError as e:
    sys.exit(f"HTTP {e.code} {dict(e.headers)}: {e.read().decode(errors='replace')}")
"""


def chat_from_pod(
    node: RealNode, model: Model, pod: str = "client", question: str = QUESTION, api_key: str = ""
) -> dict:
    timeout = scaled(120)
    proc = node.kubectl(
        "-n",
        model.namespace,
        "exec",
        pod,
        "--",
        "python3",
        "-c",
        CHAT,
        model.endpoint,
        model.served_name,
        question,
        str(timeout),
        *([api_key] if api_key else []),
        check=False,
        timeout=timeout + 30,
    )
    assert proc.returncode == 0, f"chat from pod {pod} failed:\n{proc.stderr}\n{diagnostics(node, model.namespace)}"
    return json.loads(proc.stdout)


# Run in a worker pod: GET a path of its own HTTP server with the token the router presents (derived from the
# model's secret, mounted in the pod); prints the body.
LOCAL_GET = """
import sys, urllib.request
from disagg_worker import keys
token = keys.derive(keys.read_secret(sys.argv[2], "--auth-token-file"), keys.WORKER)
req = urllib.request.Request("http://127.0.0.1:8000" + sys.argv[1], headers={"Authorization": f"Bearer {token}"})
print(urllib.request.urlopen(req, timeout=10).read().decode())
"""


def worker_get(node: RealNode, namespace: str, pod: str, path: str) -> str:
    """GET `path` from the worker's own server, inside its pod (no NetworkPolicy between them)."""
    script = ("python3", "-c", LOCAL_GET, path, auth_token_file())
    return node.kubectl("-n", namespace, "exec", pod, "--", *script).stdout


# Run in the router pod: GET a path of its own server (its /health answers 200 or 503, with the same body).
ROUTER_GET = """
import sys, urllib.error, urllib.request
try:
    print(urllib.request.urlopen("http://127.0.0.1:8000" + sys.argv[1], timeout=10).read().decode())
except urllib.error.HTTPError as e:
    print(e.read().decode())
"""


def router_get(node: RealNode, model: Model, path: str) -> str:
    (router,) = model.pods(node, "router")
    cmd = ("exec", router["metadata"]["name"], "--", "python3", "-c", ROUTER_GET, path)
    return node.kubectl("-n", model.namespace, *cmd).stdout


def verified_decodes(node: RealNode, model: Model) -> set[str]:
    """The decode pods the router has verified a pair with (and so sends requests to): its /health lists every
    worker and every pair it verified."""
    health = json.loads(router_get(node, model, "/health"))
    return {p["decode"] for p in health.get("pairs", []) if p["verified"]}


def router_migrations(node: RealNode, model: Model) -> float:
    """The router's `disagg_router_migrations_total`, every cause together."""
    text = router_get(node, model, "/metrics")
    return sum(float(v) for v in re.findall(r"^disagg_router_migrations_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def wait_all_decodes_paired(node: RealNode, model: Model) -> list[str]:
    """Wait until the router has verified a pair with every decode pod (it finds new pods by DNS, then
    verifies them); their names."""
    names = sorted(p["metadata"]["name"] for p in model.pods(node, "decode"))
    wait_until(lambda: set(names) <= verified_decodes(node, model), 120, POLL_S, what=f"the router pairing {names}")
    return names


def requests_finished(node: RealNode, namespace: str, pod: str) -> float:
    """The worker's `disagg_requests_total` (requests it finished, health probes apart)."""
    text = worker_get(node, namespace, pod, "/metrics")
    found = re.findall(r"^disagg_requests_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def running(node: RealNode, namespace: str, pod: str) -> int:
    """Requests the worker's scheduler runs now (its /stats)."""
    return int(json.loads(worker_get(node, namespace, pod, "/stats"))["running"])


# Run in the client pod: N clients each sending streamed chat requests back to back (a refusal is retried
# after its Retry-After) until the stop file exists; every request's outcome is appended to the log file as
# one JSON line, and the same lines go to stdout at the end.
LOAD = r"""
import json, os, sys, threading, time, urllib.error, urllib.request
url, model, clients, max_tokens, stop, log = sys.argv[1:7]
lock = threading.Lock()
def one():
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story about a dragon."}],
            "max_tokens": int(max_tokens), "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = {"start": time.time(), "status": None, "chunks": 0, "end": None, "error": None, "retry_after": None}
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            r["status"] = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    r["end"] = "done" if r["end"] is None else r["end"] + "+done"
                    break
                event = json.loads(data)
                if "error" in event:
                    r["end"], r["error"] = "error-event", str(event["error"].get("message"))[:300]
                else:
                    r["chunks"] += 1
    except urllib.error.HTTPError as e:
        r["status"], r["retry_after"] = e.code, e.headers.get("Retry-After")
        r["error"] = e.read().decode(errors="replace")[:300]
    except Exception as e:
        r["error"] = repr(e)[:300]
    r["finish"] = time.time()
    return r
def client():
    while not os.path.exists(stop):
        r = one()
        with lock, open(log, "a") as f:
            f.write(json.dumps(r) + "\n")
        if r["status"] != 200:
            time.sleep(min(float(r["retry_after"] or 1), 2))
threads = [threading.Thread(target=client) for _ in range(int(clients))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(open(log).read(), end="")
"""


class Load:
    """Streaming chat load from the client pod through the router's Service, as `LOAD` sends it."""

    def __init__(self, node: RealNode, model: Model, clients: int = 8, max_tokens: int = 160):
        self.node, self.model = node, model
        tag = uuid.uuid4().hex[:6]
        self.stop_file, self.log = f"/tmp/stop-{tag}", f"/tmp/load-{tag}.jsonl"
        self.proc = subprocess.Popen(
            [str(node.bin_dir / "kubectl"), "--kubeconfig", str(node.kubeconfig), "-n", model.namespace]
            + ["exec", "client", "--", "python3", "-c", LOAD, model.endpoint, model.served_name]
            + [str(clients), str(max_tokens), self.stop_file, self.log],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def results(self) -> list[dict]:
        """The requests finished so far."""
        proc = self.node.kubectl("-n", self.model.namespace, "exec", "client", "--", "cat", self.log, check=False)
        # The last line may be half written: only complete lines (newline-terminated) count.
        return [json.loads(line) for line in proc.stdout.splitlines(keepends=True) if line.endswith("\n")]

    def stop(self) -> list[dict]:
        """Let every client finish its request, then every request's outcome."""
        self.node.kubectl("-n", self.model.namespace, "exec", "client", "--", "touch", self.stop_file)
        out, err = self.proc.communicate(timeout=scaled(600))
        assert self.proc.returncode == 0, f"the load generator failed: {err}"
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.node.kubectl("-n", self.model.namespace, "exec", "client", "--", "touch", self.stop_file, check=False)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=scaled(600))
            if self.proc.poll() is None:
                self.proc.kill()


def in_flight_at(results: list[dict], moment: float) -> list[dict]:
    """The requests that had started streaming before `moment` and finished after it."""
    return [r for r in results if r["status"] == 200 and r["start"] < moment < r["finish"]]


def refused(r: dict) -> bool:
    """A request the router refused before streaming, with the Retry-After a client honours."""
    return r["status"] in (429, 503) and r["retry_after"] is not None


def outcomes_since(results: list[dict], moment: float) -> list[tuple]:
    """(status, error, start and finish relative to `moment`) of each request: what a failed assertion shows."""
    return [(r["status"], r["error"], f"{r['start'] - moment:+.1f}s", f"{r['finish'] - moment:+.1f}s") for r in results]


def summary(results: list[dict]) -> str:
    done = sum(r["end"] == "done" for r in results)
    return f"{len(results)} requests: {done} ended with [DONE], {sum(refused(r) for r in results)} refused (503)"
