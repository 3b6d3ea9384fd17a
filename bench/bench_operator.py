"""Operator benchmark: apply N DisaggregatedModels at once on the local control plane and measure

- the time until every child of every CR exists and every CR has a status for its generation,
- the time until every CR is Ready (kwok makes the pods ready),
- the operator's API calls per CR (through a counting proxy, by verb), and its writes once converged.

Usage: .venv/bin/python bench/bench_operator.py [--count 100] [--idle 60]
Needs the cluster of `make cluster` (.cluster/kubeconfig); results go to bench/results/operator.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))

from conftest import KubeCluster  # noqa: E402
from test_operator_support import OperatorUnderTest, install_chart, load_example, wait_until  # noqa: E402

CHILDREN_PER_CR = 12  # 4 Services, 2 StatefulSets, 1 Deployment, 3 PDBs, 1 NetworkPolicy, 1 Secret
KINDS = "statefulsets,deployments,services,poddisruptionbudgets,networkpolicies,secrets"


def cluster_from_repo(kubeconfig: Path) -> KubeCluster:
    bin_dir = Path(subprocess.run([str(REPO / "hack/k8s/build.sh"), "--bin-dir"], capture_output=True,
                                  text=True, check=True).stdout.strip().splitlines()[-1])
    return KubeCluster(kubeconfig=kubeconfig, bin_dir=bin_dir, _helm_home=Path(tempfile.mkdtemp()))


def progress(cluster: KubeCluster, ns: str, count: int) -> tuple[int, int, int]:
    """(children that exist, CRs with a status for their generation, CRs Ready)."""
    children = len(cluster.kubectl("-n", ns, "get", KINDS, "-l", "app.kubernetes.io/managed-by=disagg-operator",
                                   "-o", "name").stdout.split())
    crs = cluster.get("-n", ns, "dm")["items"]
    statused = sum(1 for cr in crs if cr.get("status", {}).get("observedGeneration") == cr["metadata"]["generation"]
                   and len(cr["status"].get("conditions", [])) == 3)
    ready = sum(1 for cr in crs for c in cr.get("status", {}).get("conditions", [])
                if c["type"] == "Ready" and c["status"] == "True")
    return children, statused, ready


def run(cluster: KubeCluster, count: int, idle: float, timeout: float, settle: float = 60) -> dict:
    install_chart(cluster)
    wait_until(lambda: not [n for n in cluster.get("namespaces")["items"]
                            if n["status"].get("phase") == "Terminating"], 300, 2, "earlier namespaces deleted")
    op = OperatorUnderTest(cluster, Path(tempfile.mkdtemp()))
    op.start()
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    items = [load_example("dm-cpu-tcp.yaml", name=f"m{i:03d}") for i in range(count)]
    for cr in items:  # the two kwok nodes hold 220 pods: no requests, so CPU is not what limits
        for role in ("prefill", "decode"):
            cr["spec"][role].pop("resources", None)
    load_before = os.getloadavg()[0]
    before = op.proxy.snapshot()
    t0 = time.monotonic()
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                     "items": items}))
    t_children = t_status = t_ready = None
    ready = 0
    while time.monotonic() - t0 < timeout:
        children, statused, ready = progress(cluster, ns, count)
        now = time.monotonic() - t0
        if t_children is None and children >= count * CHILDREN_PER_CR:
            t_children = now
        if t_status is None and statused == count:
            t_status = now
        if ready == count:
            t_ready = now
            break
        if t_status is not None and t_children is not None and now - max(t_status, t_children) > settle:
            break  # pods beyond the nodes' capacity stay Pending: their CRs cannot become Ready
        time.sleep(2)
    converged = op.proxy.snapshot()
    load_after = os.getloadavg()[0]
    calls = {f"{m} {k}": converged[(m, k)] - before[(m, k)] for (m, k) in converged
             if converged[(m, k)] != before[(m, k)]}
    time.sleep(idle)
    idle_calls = op.proxy.snapshot()
    idle_writes = {f"{m} {k}": idle_calls[(m, k)] - converged[(m, k)] for (m, k) in idle_calls
                   if m != "GET" and idle_calls[(m, k)] != converged[(m, k)]}
    op.stop()
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    writes = sum(n for k, n in calls.items() if not k.startswith("GET"))
    return {
        "crs": count, "children_per_cr": CHILDREN_PER_CR, "cpu_count": os.cpu_count(),
        "load_average_1m_before_and_after": [round(load_before, 2), round(load_after, 2)],
        "seconds_until_all_children_exist": t_children, "seconds_until_every_status_written": t_status,
        "seconds_until_all_ready": t_ready, "crs_ready": ready,
        "api_calls_until_ready": calls, "writes_per_cr": round(writes / count, 2),
        "reads_per_cr": round(sum(n for k, n in calls.items() if k.startswith("GET")) / count, 2),
        "idle_seconds": idle, "writes_while_idle": idle_writes,
    }


def markdown(r: dict) -> str:
    rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(r["api_calls_until_ready"].items()))
    return f"""# Operator benchmark

{r['crs']} DisaggregatedModels (examples/dm-cpu-tcp.yaml, renamed) applied with one `kubectl apply` on the local
control plane (etcd, kube-apiserver, controller-manager, scheduler built from source; kwok nodes). The operator
runs as a local process with the chart's ServiceAccount; its API calls are counted by a proxy.
Machine: {r['cpu_count']} CPUs shared with other work, 1-minute load average {r['load_average_1m_before_and_after'][0]}
before and {r['load_average_1m_before_and_after'][1]} after the run.

| measure | value |
|---|---|
| all {r['crs'] * r['children_per_cr']} children exist | {r['seconds_until_all_children_exist']} s |
| every status written | {r['seconds_until_every_status_written']} s |
| CRs Ready (3 pods each; the 2 kwok nodes hold 220 pods) | {r['crs_ready']} of {r['crs']} |
| every CR Ready | {r['seconds_until_all_ready']} s |
| API writes per CR (until converged) | {r['writes_per_cr']} |
| API reads per CR (until converged; watch requests included) | {r['reads_per_cr']} |
| writes during {r['idle_seconds']} s idle | {sum(r['writes_while_idle'].values())} |

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
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
