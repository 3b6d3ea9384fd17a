"""The demo model served on the real node, as a user runs it: the chart installs the operator as pods (two
replicas, one active), the README's Kubernetes block runs as written (it applies `examples/dm-smollm2-cpu.yaml`,
waits for Ready and asks the router through a port-forward), and the model answers OpenAI chat requests
through the router's Service, from this machine (port-forward, the official `openai` client) and from a pod
(Service DNS). Then day two on the same pods: NetworkPolicies enforced both ways, a decode pod deleted under
streaming load, an image change under streaming load in place and then with a surge, and the active operator
replica deleted while the model is scaled.

One DisaggregatedModel serves every test of the module, in file order: each leaves it Ready.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import openai
import pytest
import requests
import yaml

from tests.e2e import readme
from tests.e2e.conftest import OPERATOR_NS, OPERATOR_RELEASE, RealNode, new_namespace
from tests.e2e.models import (
    EXAMPLE,
    MODEL_LABEL,
    OPERATOR_SELECTOR,
    POLL_S,
    QUESTION,
    ROLE_LABEL,
    Load,
    Model,
    chat_from_pod,
    conditions,
    diagnostics,
    free_port,
    in_flight_at,
    model_ready,
    outcomes_since,
    pod_ready,
    port_forward,
    refused,
    requests_finished,
    running,
    served,
    summary,
    wait_all_decodes_paired,
)
from tests.timing import scaled, wait_until

# Setting up the module (image import, operator, model Ready) runs inside the first test's timeout.
pytestmark = pytest.mark.timeout(scaled(2400))


@pytest.fixture(scope="module")
def readme_block(
    real_node: RealNode,
    operator_release: str,
    worker_image: str,
    operator_image: str,
    report: Callable[[str], None],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Model, str]]:
    """The README's Kubernetes block after its helm line (which installed the session's operator), run as written
    in a fresh namespace, and what it printed; the model it applied serves every test of the module."""
    namespace = new_namespace(real_node, "e2e-model")
    assert readme.applied() == EXAMPLE
    cr = yaml.safe_load(EXAMPLE.read_text())
    cr["metadata"]["namespace"] = namespace  # where the block's kubeconfig puts it
    assert cr["spec"]["image"] == worker_image  # imported into the node's containerd: IfNotPresent pulls nothing
    printed: list[str] = []

    def run() -> None:
        workdir = tmp_path_factory.mktemp("readme")
        try:
            printed.append(readme.run(real_node.kubeconfig, real_node.bin_dir, namespace, free_port(), workdir, 900))
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diagnostics(real_node, namespace)}") from None

    what = "examples/dm-smollm2-cpu.yaml, applied by the README's block (its first answer included),"
    with served(real_node, cr, operator_image, report, what, apply=run) as m:
        yield m, printed[0]


@pytest.fixture(scope="module")
def model(readme_block: tuple[Model, str]) -> Model:
    return readme_block[0]


def test_the_readmes_kubernetes_block_runs_as_written(readme_block: tuple[Model, str]) -> None:
    """What the block printed: the wait's condition met, `kubectl get dm` as the README shows it, the answer. It
    ran in a namespace of its own and with a free local port for the port-forward, otherwise as written."""
    model, printed = readme_block
    lines = printed.splitlines()
    assert f"disaggregatedmodel.disagg.dev/{model.name} condition met" in lines, printed
    # `kubectl get dm` prints what the README shows under it; only the namespace in the endpoint and the age differ.
    header, row = readme.shown_table()
    rows = [line.split() for line in lines]
    assert header in rows, printed
    got = rows[rows.index(header) + 1]
    assert got[:-1] == [*row[:-2], row[-2].replace(".default.", f".{model.namespace}.")], printed
    assert got[-2] == model.endpoint
    # The block ends with the first request through the router: its answer, as JSON.
    answer = json.loads("\n".join(lines[rows.index(header) + 2 :]))
    assert answer["model"] == model.served_name
    assert "Paris" in answer["choices"][0]["message"]["content"], answer


def test_chat_through_port_forward_with_the_openai_client(
    real_node: RealNode, model: Model, report: Callable[[str], None]
) -> None:
    with port_forward(real_node, model.namespace, model.router_service, 8000) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=scaled(120), max_retries=0)
        start = time.monotonic()
        try:
            reply = client.chat.completions.create(
                model=model.served_name,
                messages=[{"role": "user", "content": QUESTION}],
                temperature=0,
                max_tokens=32,
            )
        except openai.APIError as e:
            raise AssertionError(f"{e!r}\n{diagnostics(real_node, model.namespace)}") from None
        report(f"first answer {time.monotonic() - start:.1f}s after the request: {reply.choices[0].message.content!r}")
        assert reply.model == model.served_name
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 32

        # The same question streamed: the client iterates to the end of the stream ([DONE]) without an error.
        stream = client.chat.completions.create(
            model=model.served_name,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=32,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len(pieces) > 1
        assert "Paris" in "".join(pieces)

        # The raw event stream: every event is a `data:` line and the last one is [DONE].
        body = {
            "model": model.served_name,
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 8,
            "stream": True,
        }
        with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=scaled(120)) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            data = [line for line in resp.iter_lines(decode_unicode=True) if line.startswith("data:")]
        assert data[-1].removeprefix("data:").strip() == "[DONE]"
        assert all(json.loads(d.removeprefix("data:"))["object"] == "chat.completion.chunk" for d in data[:-1])


def test_chat_from_a_pod_through_the_router_service_name(real_node: RealNode, model: Model) -> None:
    assert model.endpoint == f"http://{model.router_service}.{model.namespace}.svc:8000"
    reply = chat_from_pod(real_node, model)
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_the_cr_reports_what_kubectl_describe_shows(real_node: RealNode, model: Model) -> None:
    cr = real_node.get("-n", model.namespace, f"disaggregatedmodels/{model.name}")
    assert conditions(cr) | {"Ready": "True", "PairingVerified": "True"} == conditions(cr)
    described = real_node.kubectl("-n", model.namespace, "describe", "disaggregatedmodels", model.name).stdout
    events = described.split("Events:", 1)[1]
    assert "Ready=True" in events, described


# Run in a worker pod: who it runs as, whether its root file system is mounted read-only, and whether /tmp is
# a mount of its own that takes a write.
WHOAMI = """
import json, os
def writable(path):
    try:
        with open(os.path.join(path, ".e2e-probe"), "w"):
            pass
        os.remove(os.path.join(path, ".e2e-probe"))
        return True
    except OSError:
        return False
print(json.dumps({
    "uid": os.getuid(),
    "root_read_only": bool(os.statvfs("/").f_flag & os.ST_RDONLY),
    "tmp_own_mount": os.stat("/tmp").st_dev != os.stat("/").st_dev,
    "tmp_writable": writable("/tmp"),
}))
"""


def test_workers_run_unprivileged_on_a_read_only_root(real_node: RealNode, model: Model) -> None:
    for role in ("prefill", "decode", "router"):
        (pod,) = model.pods(real_node, role)
        name = pod["metadata"]["name"]
        proc = real_node.kubectl("-n", model.namespace, "exec", name, "--", "python3", "-c", WHOAMI)
        # What the chart's securityContext says, enforced by the runtime: torch, xgrammar, tokenizers and
        # Mooncake started and serve with nothing writable but the pod's /tmp emptyDir.
        expected = {"uid": 1000, "root_read_only": True, "tmp_own_mount": True, "tmp_writable": True}
        assert json.loads(proc.stdout) == expected, role
        # The container's log shows it serving, as `kubectl logs` shows it to a user.
        log = real_node.kubectl("-n", model.namespace, "logs", name).stdout
        banner = "disagg router on http://" if role == "router" else f"disagg {role} instance of {model.served_name}"
        assert banner in log, log[-2000:]


# Run in the client pod: connect to every "ip:port" argument at once; prints {"ip:port": "open" | error}.
PROBE = """
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def probe(target):
    host, port = target.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=float(sys.argv[1])).close()
        return "open"
    except socket.timeout:
        return "timeout"
    except OSError as e:
        return type(e).__name__
with ThreadPoolExecutor(len(sys.argv) - 2) as pool:
    print(json.dumps(dict(zip(sys.argv[2:], pool.map(probe, sys.argv[2:])))))
"""

# Run in a worker pod: the TCP ports it listens on, on any address but loopback.
LISTENING = """
import json
ports = set()
for line in open("/proc/net/tcp").readlines()[1:]:
    local, state = line.split()[1], line.split()[3]
    address, port = local.split(":")
    if state == "0A" and address != "0100007F":
        ports.add(int(port, 16))
print(json.dumps(sorted(ports)))
"""


def _probe(node: RealNode, namespace: str, targets: list[str]) -> dict[str, str]:
    proc = node.kubectl("-n", namespace, "exec", "client", "--", "python3", "-c", PROBE, str(scaled(3)), *targets)
    return json.loads(proc.stdout)


def test_network_policies_keep_other_pods_off_every_worker_port(real_node: RealNode, model: Model) -> None:
    ns = ("-n", model.namespace)
    policies = real_node.get(*ns, "networkpolicies", "-l", f"{MODEL_LABEL}={model.name}")["items"]
    by_role = {p["metadata"]["labels"][ROLE_LABEL]: p for p in policies}
    assert set(by_role) == {"prefill", "decode", "router"}

    targets: set[str] = set()  # every "ip:port" a worker policy covers
    listening: set[str] = set()  # of those, the ones a worker listens on
    for role in ("prefill", "decode"):
        (pod,) = model.pods(real_node, role)
        ip = pod["status"]["podIP"]
        ports: set[int] = set()
        for rule in by_role[role]["spec"]["ingress"]:
            assert rule.get("from"), f"the {role} policy admits anyone: {rule}"  # only the model's own pods
            for p in rule["ports"]:
                ports.update(range(p["port"], p.get("endPort", p["port"]) + 1))
        targets.update(f"{ip}:{p}" for p in ports)
        out = real_node.kubectl(*ns, "exec", pod["metadata"]["name"], "--", "python3", "-c", LISTENING).stdout
        bound = set(json.loads(out))
        # Every port the worker listens on is one its policy names: HTTP, bootstrap (prefill), control, and
        # the transfer engine's.
        assert bound <= ports, (role, sorted(bound - ports))
        listening.update(f"{ip}:{p}" for p in bound)
    assert len(listening) >= 5, sorted(listening)  # prefill: http, bootstrap, control, transfer; decode: more

    # The model serves (router -> prefill and decode, prefill <-> decode) with the policies in place, while a
    # pod without the model's labels reaches none of those ports.
    assert "Paris" in chat_from_pod(real_node, model)["choices"][0]["message"]["content"]
    blocked = _probe(real_node, model.namespace, sorted(targets))
    assert not [t for t, r in blocked.items() if r == "open"], f"open to a pod without the model's labels: {blocked}"

    # Without the operator (it would put them back) and without the policies, the same probe connects.
    real_node.kubectl("-n", OPERATOR_NS, "scale", f"deployment/{OPERATOR_RELEASE}", "--replicas=0")
    real_node.kubectl(
        "-n", OPERATOR_NS, "wait", "--for=delete", "pod", "-l", OPERATOR_SELECTOR, "--timeout=120s", timeout=150
    )
    try:
        real_node.kubectl(*ns, "delete", "networkpolicies", "-l", f"{MODEL_LABEL}={model.name}")

        def opened() -> dict[str, str] | None:
            result = _probe(real_node, model.namespace, sorted(listening))
            return result if all(r == "open" for r in result.values()) else None

        try:
            wait_until(opened, 60, POLL_S, what="the worker ports open once the policies are deleted")
        except TimeoutError as e:
            raise AssertionError(f"{e}\nbefore: {blocked}") from None
    finally:
        real_node.kubectl("-n", OPERATOR_NS, "scale", f"deployment/{OPERATOR_RELEASE}", "--replicas=2")
    # The operator, back, restores the policies (level-triggered reconcile), and they hold again.
    wait_until(
        lambda: len(real_node.get(*ns, "networkpolicies", "-l", f"{MODEL_LABEL}={model.name}")["items"]) == 3,
        180,
        POLL_S,
        what="the operator restoring the NetworkPolicies",
    )
    wait_until(
        lambda: all(r != "open" for r in _probe(real_node, model.namespace, sorted(listening)).values()),
        60,
        POLL_S,
        what="the restored policies closing the worker ports again",
    )
    real_node.kubectl(
        "-n", OPERATOR_NS, "rollout", "status", f"deployment/{OPERATOR_RELEASE}", "--timeout=300s", timeout=330
    )


def _decode_holds(node: RealNode, model: Model, n: int) -> str:
    """Wait until the decode pod runs at least `n` requests (the load is in flight); its name."""
    (pod,) = model.pods(node, "decode")
    name = pod["metadata"]["name"]
    wait_until(lambda: running(node, model.namespace, name) >= n, 120, POLL_S, what=f"{n} requests running on {name}")
    return name


def _answered_after(load: Load, moment: float) -> bool:
    """A request started after `moment` streamed to [DONE]: new requests are answered."""
    return any(r["start"] > moment and r["end"] == "done" for r in load.results())


def test_a_decode_pod_deleted_under_load_drains_and_comes_back(
    real_node: RealNode, model: Model, report: Callable[[str], None]
) -> None:
    ns = ("-n", model.namespace)
    with Load(real_node, model) as load:
        old = _decode_holds(real_node, model, 8)
        uid = real_node.get(*ns, f"pod/{old}")["metadata"]["uid"]
        deleted = time.time()
        # The pod's preStop hook keeps it serving while it leaves the Service and the router; then SIGTERM, and
        # the worker finishes what it holds before it exits (its grace period covers both).
        real_node.kubectl(*ns, "delete", "pod", old, "--wait=true", "--timeout=300s", timeout=330)
        gone = time.time()

        def back() -> bool:
            pods = model.pods(real_node, "decode")
            return len(pods) == 1 and pods[0]["metadata"]["uid"] != uid and pod_ready(pods[0])

        wait_until(back, 300, POLL_S, what="the decode pod back and Ready")
        wait_until(lambda: model_ready(real_node, model.namespace, model.name), 300, POLL_S, what="the model Ready")
        recovered = time.time()
        wait_until(lambda: _answered_after(load, recovered), 300, POLL_S, what="a request answered afterwards")
        results = load.stop()

    held = in_flight_at(results, deleted)
    grace = model.pods(real_node, "decode")[0]["spec"]["terminationGracePeriodSeconds"]
    report(
        f"decode pod deleted under load: gone {gone - deleted:.1f}s after kubectl delete (grace period {grace}s), "
        f"model Ready again {recovered - deleted:.0f}s after; {len(held)} streams in flight at the deletion; "
        + summary(results)
    )
    assert len(held) >= 8, summary(results)
    # Every stream that started ends with [DONE] or an error event, never cut off; and a drained pod finishes
    # what it held: the streams in flight at the deletion end with [DONE].
    cut = [r for r in results if r["status"] == 200 and r["end"] not in ("done", "error-event+done")]
    assert not cut, cut
    assert all(r["end"] == "done" for r in held), [r for r in held if r["end"] != "done"]
    # Anything else was refused before it started, with a Retry-After the client honoured.
    others = [r for r in results if not (r["status"] == 200 or refused(r))]
    assert not others, outcomes_since(others, deleted)


def _images(node: RealNode, model: Model) -> dict[str, list[str]]:
    """The image each role's pods run (pods being deleted included), by role."""
    pods = node.get("-n", model.namespace, "pods", "-l", f"{MODEL_LABEL}={model.name}")["items"]
    out: dict[str, list[str]] = {}
    for p in pods:
        out.setdefault(p["metadata"]["labels"][ROLE_LABEL], []).append(p["spec"]["containers"][0]["image"])
    return out


@dataclass
class Rolled:
    """An image change under streaming load, as the clients saw it."""

    results: list[dict]
    changed: float  # when the patch was applied
    finished: float  # when every pod ran the new image and the model was Ready again
    order: list[str]  # the roles in the order their first pod took the new image
    held: list[dict]  # the streams in flight at the change


def _change_image_under_load(
    real_node: RealNode, model: Model, image: str, rollout: dict, watch: Callable[[dict[str, list[str]]], None]
) -> Rolled:
    """Patch the model's image (and `spec.rollout`) while 8 clients stream; `watch` sees each role's images."""
    ns = ("-n", model.namespace)
    first_new: dict[str, float] = {}
    with Load(real_node, model) as load:
        _decode_holds(real_node, model, 8)
        changed = time.time()
        patch = json.dumps({"spec": {"image": image, "rollout": rollout}})
        real_node.kubectl(*ns, "patch", "disaggregatedmodels", model.name, "--type=merge", "-p", patch)

        def rolled() -> bool:
            images = _images(real_node, model)
            for role, names in images.items():
                if image in names:
                    first_new.setdefault(role, time.time())
            watch(images)
            done = all(set(names) == {image} for names in images.values())
            return done and bool(model_ready(real_node, model.namespace, model.name))

        try:
            wait_until(rolled, 900, POLL_S, what="every pod on the new image and the model Ready")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{diagnostics(real_node, model.namespace)}") from None
        finished = time.time()
        wait_until(lambda: _answered_after(load, finished), 300, POLL_S, what="a request answered afterwards")
        results = load.stop()
    order = sorted(first_new, key=first_new.__getitem__)
    return Rolled(results, changed, finished, order, in_flight_at(results, changed))


def test_an_image_change_in_place_under_load_rolls_decode_first_and_cuts_no_stream(
    real_node: RealNode, model: Model, worker_image: str, report: Callable[[str], None]
) -> None:
    retagged = f"{worker_image}-e2e"  # the same image under another name: a change of spec.image
    real_node.tag(worker_image, retagged)

    def decode_first(images: dict[str, list[str]]) -> None:
        if retagged in images.get("prefill", []):
            # Decode first: by the time a prefill pod runs the new image, every decode pod runs it, Ready.
            decodes = model.pods(real_node, "decode")
            assert decodes and all(d["spec"]["containers"][0]["image"] == retagged and pod_ready(d) for d in decodes), (
                "a prefill pod took the new image before every decode pod was on it and Ready"
            )

    rolled = _change_image_under_load(real_node, model, retagged, {"maxSurge": 0}, decode_first)
    results = rolled.results
    report(
        f"image change in place (maxSurge 0) under load: every pod on the new image and Ready "
        f"{rolled.finished - rolled.changed:.0f}s after the patch, roles in the order {rolled.order}, maxSkew default "
        f"(one pod's worth); {len(rolled.held)} streams in flight at the change; " + summary(results)
    )
    assert len(rolled.held) >= 8, summary(results)
    # Every stream that started ended with [DONE]: pods left the Services before they stopped, and each
    # finished what it held; a request that found no decode was refused before it started, with Retry-After.
    assert all(r["end"] == "done" for r in results if r["status"] == 200), [
        r for r in results if r["status"] == 200 and r["end"] != "done"
    ]
    others = [r for r in results if not (r["status"] == 200 or refused(r))]
    assert not others, outcomes_since(others, rolled.changed)


def test_an_image_change_with_a_surge_under_load_refuses_no_one(
    real_node: RealNode, model: Model, worker_image: str, report: Callable[[str], None]
) -> None:
    most: dict[str, int] = {}

    def count(images: dict[str, list[str]]) -> None:
        for role, names in images.items():
            most[role] = max(most.get(role, 0), len(names))

    # Back to the original tag, with maxSurge at its default (one pod per role).
    rolled = _change_image_under_load(real_node, model, worker_image, {"maxSurge": None}, count)
    results = rolled.results
    report(
        f"image change with a surge (maxSurge default, one pod per role) under load: every pod on the new image "
        f"and Ready {rolled.finished - rolled.changed:.0f}s after the patch, at most {most} pods per role; "
        f"{len(rolled.held)} streams in flight at the change; " + summary(results)
    )
    assert len(rolled.held) >= 8, summary(results)
    assert most.get("prefill", 0) >= 2 and most.get("decode", 0) >= 2, most  # the new pods ran beside the old
    # A new pair served while each old pod drained: nothing refused, every stream ended with [DONE].
    assert all(r["status"] == 200 for r in results), outcomes_since(
        [r for r in results if r["status"] != 200], rolled.changed
    )
    assert all(r["end"] == "done" for r in results), [r for r in results if r["end"] != "done"]
    assert {len(model.pods(real_node, role)) for role in ("prefill", "decode")} == {1}


def _active_operator(node: RealNode) -> str:
    """The operator replica kopf's peering lets work: the one with the highest priority (the oldest)."""
    peering = node.get("clusterkopfpeerings")["items"][0].get("status") or {}
    pods = node.get("-n", OPERATOR_NS, "pods", "-l", OPERATOR_SELECTOR)["items"]
    by_host = {p["metadata"]["name"]: p for p in pods if pod_ready(p)}
    # A peer's identity is "<user>@<host>/<started>/<random>" and the host is the pod's name.
    live = [(info["priority"], ident.split("@", 1)[1].split("/", 1)[0]) for ident, info in peering.items()]
    live = [(prio, host) for prio, host in live if host in by_host]
    assert len(live) == 2, peering
    return max(live)[1]


def test_the_standby_operator_takes_over_and_converges_a_change(
    real_node: RealNode, model: Model, report: Callable[[str], None]
) -> None:
    ns = ("-n", model.namespace)
    active = _active_operator(real_node)
    deleted = time.monotonic()
    real_node.kubectl("-n", OPERATOR_NS, "delete", "pod", active, "--wait=false")
    # Scaled once the active replica is gone (the Deployment's replacement is younger than the standby, so it
    # ranks below it): only the standby can act on the change.
    real_node.kubectl(
        "-n", OPERATOR_NS, "wait", "--for=delete", f"pod/{active}", "--timeout=120s", timeout=150, check=False
    )
    real_node.kubectl(*ns, "scale", "disaggregatedmodels", model.name, "--replicas=2")

    def two_decodes() -> bool:
        sts = real_node.get(*ns, "statefulsets", "-l", f"{MODEL_LABEL}={model.name},{ROLE_LABEL}=decode")
        return sts["items"][0]["spec"]["replicas"] == 2

    wait_until(two_decodes, 180, POLL_S, what="the standby scaling decode to 2")
    took_over = time.monotonic() - deleted
    try:
        wait_until(
            lambda: model_ready(real_node, model.namespace, model.name, decodes=2),
            600,
            POLL_S,
            what="two decodes Ready",
        )
    except TimeoutError as e:
        raise AssertionError(f"{e}\n{diagnostics(real_node, model.namespace)}") from None
    report(f"active operator pod deleted: its pod gone and the change converged by the standby {took_over:.1f}s later")

    # Once the router has verified the new decode, requests reach both (round robin).
    decodes = wait_all_decodes_paired(real_node, model)
    before = {d: requests_finished(real_node, model.namespace, d) for d in decodes}
    for _ in range(8):
        assert "Paris" in chat_from_pod(real_node, model)["choices"][0]["message"]["content"]
    after = {d: requests_finished(real_node, model.namespace, d) for d in decodes}
    assert all(after[d] > before[d] for d in decodes), (before, after)
