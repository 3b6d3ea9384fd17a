"""Operator benchmark: apply N DisaggregatedModels at once on the local control plane and measure

- the time until every child of every CR exists and every CR has a status for its generation,
- the time until every CR is Ready (kwok makes the pods ready),
- the operator's API calls per CR (through a counting proxy, by verb), and its writes once converged,
against a baseline measured in the same run: the same children, rendered by the operator's builders and
server-side applied straight to the API server by 16 threads (what the control plane alone needs).

Usage: .venv/bin/python bench/bench_operator.py [--count 100] [--idle 60]
Needs the cluster of `make cluster` (.cluster/kubeconfig); results go to bench/results/operator.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))
sys.path.insert(0, str(REPO / "bench"))

from test_operator_support import OperatorUnderTest, install_chart, load_example, wait_until  # noqa: E402

from common import machine_info  # noqa: E402
from conftest import KubeCluster  # noqa: E402
from disagg_operator import names  # noqa: E402

CHILDREN_PER_CR = 13  # 4 Services, 2 StatefulSets, 1 Deployment, 3 PDBs, 1 NetworkPolicy, 1 Secret, 1 RoleScaler
KINDS = "statefulsets,deployments,services,poddisruptionbudgets,networkpolicies,secrets,rolescalers"


def cluster_from_repo(kubeconfig: Path) -> KubeCluster:
    bin_dir = Path(
        subprocess.run([str(REPO / "hack/k8s/build.sh"), "--bin-dir"], capture_output=True, text=True, check=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    return KubeCluster(kubeconfig=kubeconfig, bin_dir=bin_dir, _helm_home=Path(tempfile.mkdtemp()))


def progress(cluster: KubeCluster, ns: str, count: int) -> tuple[int, int, int]:
    """(children that exist, CRs with a status for their generation, CRs Ready)."""
    children = len(
        cluster.kubectl(
            "-n", ns, "get", KINDS, "-l", "app.kubernetes.io/managed-by=disagg-operator", "-o", "name"
        ).stdout.split()
    )
    crs = cluster.get("-n", ns, "dm")["items"]
    statused = sum(
        1
        for cr in crs
        if cr.get("status", {}).get("observedGeneration") == cr["metadata"]["generation"]
        and len(cr["status"].get("conditions", [])) == len(names.CONDITION_TYPES)
    )
    ready = sum(
        1
        for cr in crs
        for c in cr.get("status", {}).get("conditions", [])
        if c["type"] == "Ready" and c["status"] == "True"
    )
    return children, statused, ready


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_items(count: int) -> list[dict]:
    items = [load_example("dm-cpu-tcp.yaml", name=f"m{i:03d}") for i in range(count)]
    for cr in items:  # the two kwok nodes hold 220 pods: no requests, so CPU is not what limits
        for role in ("prefill", "decode"):
            cr["spec"][role].pop("resources", None)
    return items


def fresh_namespace(cluster: KubeCluster) -> str:
    wait_until(
        lambda: not [n for n in cluster.get("namespaces")["items"] if n["status"].get("phase") == "Terminating"],
        300,
        2,
        "earlier namespaces deleted",
    )
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    return ns


def follow(
    cluster: KubeCluster, ns: str, count: int, t0: float, timeout: float, settle: float, want_status: bool
) -> tuple[list[list[float]], dict]:
    """Poll every 2 s until every child exists (and, with `want_status`, every status is written) and then
    `settle` more seconds or until every CR is Ready. Returns the timeline and the times, from `t0`."""
    timeline: list[list[float]] = []
    times: dict = {"children": None, "status": None if want_status else 0.0, "ready": None}
    while time.monotonic() - t0 < timeout:
        children, statused, ready = progress(cluster, ns, count)
        now = time.monotonic() - t0
        timeline.append([round(now, 2), children, statused, ready])
        if times["children"] is None and children >= count * CHILDREN_PER_CR:
            times["children"] = now
        if times["status"] is None and statused == count:
            times["status"] = now
        if ready == count:
            times["ready"] = now
            break
        if (
            times["status"] is not None
            and times["children"] is not None
            and now - max(times["status"], times["children"]) > settle
        ):
            break  # pods beyond the nodes' capacity stay Pending: their CRs cannot become Ready
        time.sleep(2)
    return timeline, times


def direct_run(cluster: KubeCluster, items: list[dict], timeout: float) -> dict:
    """Baseline: the same children, rendered by the operator's builders, server-side applied straight to the
    API server by as many threads as the operator has workers; no operator, no CRs, no status."""
    from concurrent.futures import ThreadPoolExecutor

    from kubernetes import client, config

    from disagg_operator import builders
    from disagg_operator.apply import Kube
    from disagg_operator.config import OperatorConfig
    from disagg_operator.handlers import WORKERS
    from disagg_operator.spec import ModelSpec

    ns = fresh_namespace(cluster)
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=cfg)
    cfg.connection_pool_maxsize = 2 * WORKERS
    kube = Kube(client.ApiClient(cfg))
    manifests = []
    for cr in items:
        spec = ModelSpec.from_cr({**cr, "metadata": {**cr["metadata"], "namespace": ns}})
        objs = [
            builders.build_auth_secret(spec, builders.new_token()),
            *builders.build_children(spec, OperatorConfig()),
            builders.build_role_scaler(spec, names.PREFILL),
        ]
        for obj in objs:
            obj["metadata"].pop("ownerReferences", None)  # no CR: an owner that does not exist would be collected
        manifests.append(objs)
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    pool = ThreadPoolExecutor(WORKERS)
    pending = [pool.submit(lambda objs: [kube.apply(o) for o in objs], objs) for objs in manifests]
    timeline, times = follow(cluster, ns, len(items), t0, timeout, settle=0, want_status=False)
    for f in pending:
        f.result()
    pool.shutdown()
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    return {
        "seconds_until_all_children_exist": times["children"],
        "writes": kube.writes,
        "timeline": timeline,
        "load_average_1m_before": round(load_before, 2),
    }


def operator_run(cluster: KubeCluster, items: list[dict], idle: float, timeout: float, settle: float = 60) -> dict:
    count = len(items)
    op = OperatorUnderTest(cluster, Path(tempfile.mkdtemp()))
    op.start()
    ns = fresh_namespace(cluster)
    load_before = os.getloadavg()[0]
    before = op.proxy.snapshot()
    cpu_before = cpu_seconds(op.proc.pid)
    t0 = time.monotonic()  # the clock includes `kubectl apply` itself: 100 creates, one after another
    apply = subprocess.Popen(
        [str(cluster.kubectl_path), "-n", ns, "apply", "-f", "-"],
        env=cluster.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    applied: list[float] = []
    feeder = threading.Thread(
        target=lambda: (
            apply.communicate(json.dumps({"apiVersion": "v1", "kind": "List", "items": items})),
            applied.append(time.monotonic() - t0),
        ),
        daemon=True,
    )
    feeder.start()
    timeline, times = follow(cluster, ns, count, t0, timeout, settle, want_status=True)
    feeder.join(60)
    assert apply.wait(60) == 0, "kubectl apply of the CRs failed"
    converged = op.proxy.snapshot()
    operator_cpu = cpu_seconds(op.proc.pid) - cpu_before
    load_after = os.getloadavg()[0]
    calls = {
        f"{m} {k}": converged[(m, k)] - before[(m, k)] for (m, k) in converged if converged[(m, k)] != before[(m, k)]
    }
    time.sleep(idle)
    idle_calls = op.proxy.snapshot()
    idle_writes = {
        f"{m} {k}": idle_calls[(m, k)] - converged[(m, k)]
        for (m, k) in idle_calls
        if m != "GET" and idle_calls[(m, k)] != converged[(m, k)]
    }
    op.stop()
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    writes = sum(n for k, n in calls.items() if not k.startswith("GET"))
    return {
        "crs": count,
        "children_per_cr": CHILDREN_PER_CR,
        "cpu_count": os.cpu_count(),
        "load_average_1m_before_and_after": [round(load_before, 2), round(load_after, 2)],
        "seconds_kubectl_apply_of_the_crs": round(applied[0], 1) if applied else None,
        "seconds_until_all_children_exist": times["children"],
        "seconds_until_every_status_written": times["status"],
        "seconds_until_all_ready": times["ready"],
        "crs_ready": timeline[-1][3],
        "operator_cpu_seconds_until_converged": round(operator_cpu, 1),
        "api_calls_until_ready": calls,
        "writes_per_cr": round(writes / count, 2),
        "reads_per_cr": round(sum(n for k, n in calls.items() if k.startswith("GET")) / count, 2),
        "idle_seconds": idle,
        "writes_while_idle": idle_writes,
        "timeline": timeline,
    }


def run(cluster: KubeCluster, count: int, idle: float, timeout: float) -> dict:
    install_chart(cluster)
    machine = machine_info()
    items = bench_items(count)
    result = operator_run(cluster, items, idle, timeout)
    direct = direct_run(cluster, items, timeout)  # second: the operator's run sees the same cluster as before
    result["direct_apply"] = direct
    result["machine"] = machine
    if direct["seconds_until_all_children_exist"] and result["seconds_until_all_children_exist"]:
        result["ratio_children_operator_over_direct"] = round(
            result["seconds_until_all_children_exist"] / direct["seconds_until_all_children_exist"], 2
        )
    return result


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    total = r["crs"] * r["children_per_cr"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    op, direct = r["timeline"], r["direct_apply"]["timeline"]
    ax.plot([t[0] for t in direct], [t[1] / total for t in direct], marker=".", label="children, applied directly")
    ax.plot([t[0] for t in op], [t[1] / total for t in op], marker=".", label="children, through the operator")
    ax.plot([t[0] for t in op], [t[2] / r["crs"] for t in op], marker=".", label="CRs with status written")
    ax.plot([t[0] for t in op], [t[3] / r["crs"] for t in op], marker=".", label="CRs Ready")
    if r.get("seconds_kubectl_apply_of_the_crs"):
        ax.axvline(r["seconds_kubectl_apply_of_the_crs"], color="tab:purple", linestyle=":", linewidth=1)
        ax.text(
            r["seconds_kubectl_apply_of_the_crs"] + 0.5,
            0.12,
            "kubectl apply of the CRs returns",
            color="tab:purple",
            fontsize=8,
        )
    ax.axvline(60, color="gray", linestyle="--", linewidth=1)
    ax.text(60.5, 0.05, "target 60 s", color="gray", fontsize=8)
    ax.set_xlabel("seconds after the start of kubectl apply (operator) or of the first apply (direct)")
    ax.set_ylabel("fraction done")
    ax.set_title(
        f"{r['crs']} DisaggregatedModels applied at once ({r['cpu_count']} CPUs, local control plane)", fontsize=9
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _s(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


def markdown(r: dict) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(r["api_calls_until_ready"].items()))
    return f"""# Operator benchmark

{r["crs"]} DisaggregatedModels (examples/dm-cpu-tcp.yaml, renamed) applied with one `kubectl apply` on the local
control plane (etcd, kube-apiserver, controller-manager, scheduler built from source; kwok nodes). The operator
runs as a local process with the chart's ServiceAccount; its API calls are counted by a proxy.
Machine: {r["machine"]["cpu"]}, {r["cpu_count"]} CPUs, {r["machine"]["memory_gib"]} GiB, kernel \
{r["machine"]["kernel"]}, shared with other work; 1-minute load average \
{r["load_average_1m_before_and_after"][0]} before and {r["load_average_1m_before_and_after"][1]} after the run.

| measure | value |
|---|---|
| `kubectl apply` of the {r["crs"]} CRs returned | {_s(r["seconds_kubectl_apply_of_the_crs"])} |
| all {r["crs"] * r["children_per_cr"]} children exist | {_s(r["seconds_until_all_children_exist"])} |
| baseline: the same children applied directly (16 threads, no operator) | \
{_s(r["direct_apply"]["seconds_until_all_children_exist"])} |
| ratio operator / direct | {r.get("ratio_children_operator_over_direct")} |
| every status written | {_s(r["seconds_until_every_status_written"])} |
| CRs Ready (3 pods each; the 2 kwok nodes hold 220 pods) | {r["crs_ready"]} of {r["crs"]} |
| every CR Ready | {_s(r["seconds_until_all_ready"])} |
| operator CPU until converged | {r["operator_cpu_seconds_until_converged"]} s |
| API writes per CR (until converged) | {r["writes_per_cr"]} |
| API reads per CR (until converged; watch requests included) | {r["reads_per_cr"]} |
| writes during {r["idle_seconds"]} s idle | {sum(r["writes_while_idle"].values())} |

API calls until converged, by verb and object (writes name the object kind, or `status`):

| call | count |
|---|---|
{rows}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--idle", type=float, default=60)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--kubeconfig", type=Path, default=REPO / ".cluster" / "kubeconfig")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args()
    result = run(cluster_from_repo(args.kubeconfig), args.count, args.idle, args.timeout)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "operator.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "operator.md").write_text(markdown(result))
    plot(result, args.out / "operator.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
