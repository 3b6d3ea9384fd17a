"""What tracing costs: `disagg serve --local` (router + prefill + decode) with tracing off and on, in one run.

The stacks run on the tiny model for the whole benchmark; rounds rotate between them (the order changes every
round) with the same fresh prompts for all, one request at a time (where a fixed per-request cost shows most) and
at concurrency 8. "on" samples every request (`--otlp-traces-sampling-ratio 1`) and exports its spans to a Jaeger
all-in-one started here (`hack/jaeger/build.sh`, in-memory storage); "off" is the default, no flag; with `--base
DIR`, "base" is the same stack from another checkout (the commit before tracing: what "off" costs).
Reports the median over rounds of TTFT and end-to-end p50, throughput and the CPU time the stack's processes
spent per request (less sensitive to a loaded machine than latencies), and the on / off (and off / base) ratios.
Writes bench/results/tracing.json and tracing.png (`--plot-only` redraws the plot from the JSON).
Usage: git worktree add /tmp/base <commit>; python bench/bench_tracing.py --base /tmp/base [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pd import load  # noqa: E402
from common import DISAGG, RESULTS, Serve, free_port, get_json, machine_info  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def start_jaeger() -> tuple[subprocess.Popen, str, str]:
    """Jaeger all-in-one on free ports: (its process, its OTLP/HTTP endpoint, its query URL)."""
    binary = subprocess.run([str(REPO / "hack/jaeger/build.sh")], check=True, capture_output=True, text=True)
    ports = {flag: free_port() for flag in ("admin.http", "collector.grpc-server", "collector.http-server")}
    ports |= {flag: free_port() for flag in ("collector.otlp.grpc", "collector.otlp.http")}
    ports |= {flag: free_port() for flag in ("query.grpc-server", "query.http-server")}
    proc = subprocess.Popen(
        [binary.stdout.splitlines()[-1], *(f"--{f}.host-port=127.0.0.1:{p}" for f, p in ports.items())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    query = f"http://127.0.0.1:{ports['query.http-server']}"
    for _ in range(100):
        try:
            get_json(f"{query}/api/services")
            break
        except OSError:
            time.sleep(0.2)
    return proc, f"127.0.0.1:{ports['collector.otlp.http']}", query


def cpu_s(s: Serve) -> float:
    """CPU seconds (user and system) the stack's processes have used so far."""
    import psutil

    assert s.proc is not None
    top = psutil.Process(s.proc.pid)
    total = 0.0
    for p in [top, *top.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def rounds(servers: dict[str, Serve], a: argparse.Namespace, n: int, concurrency: int, seed: int) -> dict:
    got: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order if r % 2 == 0 else order[::-1]:
            before = cpu_s(servers[name])
            rep = load(
                servers[name].url,
                n=n,
                concurrency=concurrency,
                input_len=a.input_len,
                output_len=a.output_len,
                seed=seed + r,
            )
            rep["cpu_ms_per_request"] = (cpu_s(servers[name]) - before) * 1000 / n
            got[name].append(rep)
            print(
                f"  round {r} {name:>4}: TTFT p50 {rep['p50_ttft_ms']:.1f} e2e p50 {rep['p50_e2e_ms']:.1f} ms, "
                f"CPU {rep['cpu_ms_per_request']:.1f} ms/request"
            )
    keys = ("p50_ttft_ms", "p50_e2e_ms", "request_throughput", "cpu_ms_per_request")
    med = {name: {k: statistics.median(x[k] for x in reps) for k in keys} for name, reps in got.items()}
    res = {"median": med, "ratio_on_over_off": {k: med["on"][k] / med["off"][k] for k in keys}}
    if "base" in med:
        res["ratio_off_over_base"] = {k: med["off"][k] / med["base"][k] for k in keys}
    return res | {"rounds": got, "concurrency": concurrency, "requests": n}


def plot(res: dict, path: Path) -> None:
    """CPU time per request by stack at each concurrency, with the on / off and off / base ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("c1", "c8") if k in res]
    stacks = [s for s in ("base", "off", "on") if all(s in res[k]["median"] for k in keys)]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        ax.bar(stacks, [res[key]["median"][s]["cpu_ms_per_request"] for s in stacks])
        named = (("on/off", "ratio_on_over_off"), ("off/base", "ratio_off_over_base"))
        ratios = [f"{name} x{res[key][r]['cpu_ms_per_request']:.2f}" for name, r in named if res[key].get(r)]
        ax.set_title(f"concurrency {key[1:]}: {', '.join(ratios)}", fontsize=9)
        ax.set_ylabel("CPU ms per request (median)")
    m = res["machine"]
    fig.suptitle(f"tracing cost ({m['cpu']}, {m['cores']} cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--base", default="", help="a checkout without tracing, run as a third stack")
    ap.add_argument("--plot-only", action="store_true", help="redraw tracing.png from tracing.json")
    a = ap.parse_args(argv)
    if a.plot_only:
        plot(json.loads((RESULTS / "tracing.json").read_text()), RESULTS / "tracing.png")
        return 0
    t0 = time.time()
    model = tempfile.mkdtemp(prefix="bench-tracing-model-")
    subprocess.run([DISAGG, "model", "make-tiny", "--out", model], check=True, stdout=subprocess.DEVNULL)
    jaeger, otlp, query = start_jaeger()
    env = {"OMP_NUM_THREADS": "1"}
    flags = ("--local", "--torch-threads", "1")
    tracing = ("--otlp-traces-endpoint", otlp, "--otlp-traces-sampling-ratio", "1")
    servers = {
        "off": Serve(model, *flags, env=env, name="bench-tracing"),
        "on": Serve(model, *flags, *tracing, env=env, name="bench-tracing"),
    }
    if a.base:
        base = Path(a.base).resolve()
        path = {"PYTHONPATH": f"{base / 'worker'}:{base / 'operator'}:{base / 'api'}"}
        servers["base"] = Serve(model, *flags, env=env | path, name="bench-tracing")
    res: dict = {"machine": machine_info(), "config": vars(a)}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_healthy()
        for s in servers.values():  # warm-up: first forwards, first transfer connections, the exporter's session
            load(s.url, n=4, concurrency=2, input_len=a.input_len, output_len=a.output_len, seed=999)
        print("concurrency 1", flush=True)
        res["c1"] = rounds(servers, a, a.requests, 1, 1000)
        print("concurrency 8", flush=True)
        res["c8"] = rounds(servers, a, 2 * a.requests, 8, 2000)
        res["traced_services"] = sorted(get_json(f"{query}/api/services").get("data") or [])
    finally:
        for s in servers.values():
            s.stop()
        jaeger.kill()
        jaeger.wait()
        shutil.rmtree(model, ignore_errors=True)
    res["seconds"] = round(time.time() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "tracing.png")
    for key in ("c1", "c8"):
        for ratio in ("ratio_on_over_off", "ratio_off_over_base"):
            r = res[key].get(ratio)
            if r:
                print(
                    f"{key} {ratio}: TTFT p50 x{r['p50_ttft_ms']:.3f}, e2e p50 x{r['p50_e2e_ms']:.3f}, "
                    f"CPU/request x{r['cpu_ms_per_request']:.3f}"
                )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
