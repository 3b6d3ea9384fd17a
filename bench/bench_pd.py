"""P/D serving latency: `disagg serve --local` (router + prefill + decode, Mooncake TCP) vs the
monolithic `disagg serve`, same tiny model, same prompts, loaded by `disagg bench serve`.

Both servers run for the whole benchmark; rounds alternate between them (A B, B A, ...) so a
slow phase of a shared machine hits both. Every round sends fresh random token-id prompts
(a new seed per round, the same seed for both servers), so the prefix cache never helps.
  low load:      --low-requests prompts of --input-len tokens, one at a time (concurrency 1)
  short prompts: the same at --short-len tokens: what the P/D path costs regardless of length
  moderate load: --mid-requests prompts at concurrency 8 (for information)
Reports TTFT p50/p90 (median over rounds) and the P/D / monolithic ratio.
Writes bench/results/pd.json and pd.png.  Usage: python bench/bench_pd.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disagg_worker.bench import serve as serve_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DISAGG, RESULTS, Serve, machine_info  # noqa: E402

KEYS = ("p50_ttft_ms", "p90_ttft_ms", "mean_ttft_ms", "p50_itl_ms", "p50_e2e_ms", "request_throughput")


def load(url: str, *, n: int, concurrency: int, input_len: int, output_len: int, seed: int) -> dict:
    p = argparse.ArgumentParser()
    serve_bench.add_args(p)
    ns = p.parse_args(
        [
            "--base-url",
            url,
            "--num-prompts",
            str(n),
            "--max-concurrency",
            str(concurrency),
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--seed",
            str(seed),
            "--vocab-high",
            "2000",
        ]
    )
    report = asyncio.run(serve_bench.bench(ns))
    if report["failed"]:
        raise RuntimeError(f"{url}: {report['failed']} requests failed: {report.get('errors')}")
    return {k: report[k] for k in KEYS}


def interleaved(
    servers: dict[str, Serve], a: argparse.Namespace, *, n: int, concurrency: int, base_seed: int, input_len: int = 0
) -> dict:
    """Rounds A B, B A, ... with the same fresh prompts for both servers in each round."""
    input_len = input_len or a.input_len
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rep = load(
                servers[name].url,
                n=n,
                concurrency=concurrency,
                input_len=input_len,
                output_len=a.output_len,
                seed=base_seed + r,
            )
            rounds[name].append(rep)
            print(
                f"  round {r} {name:>4}: TTFT p50 {rep['p50_ttft_ms']:.1f} p90 {rep['p90_ttft_ms']:.1f} ms", flush=True
            )
    med = {name: {k: statistics.median(x[k] for x in reps) for k in KEYS} for name, reps in rounds.items()}
    ratio = {k: med["pd"][k] / med["mono"][k] for k in ("p50_ttft_ms", "p90_ttft_ms", "mean_ttft_ms")}
    return {
        "median": med,
        "ratio_pd_over_mono": ratio,
        "rounds": rounds,
        "config": {"requests": n, "concurrency": concurrency, "input_len": input_len, "output_len": a.output_len},
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, key, title in ((axes[0], "low", "low load (concurrency 1)"), (axes[1], "moderate", "concurrency 8")):
        med = res[key]["median"]
        xs = range(2)
        for i, (name, label) in enumerate((("mono", "monolithic"), ("pd", "P/D --local"))):
            vals = [med[name]["p50_ttft_ms"], med[name]["p90_ttft_ms"]]
            ax.bar([x + 0.38 * i for x in xs], vals, width=0.38, label=label)
        ax.set_xticks([x + 0.19 for x in xs], ["TTFT p50", "TTFT p90"])
        ratio = res[key]["ratio_pd_over_mono"]["p50_ttft_ms"]
        ax.set_title(f"{title}: P/D / mono p50 = {ratio:.2f}", fontsize=9)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    m = res["machine"]
    fig.suptitle(f"{res['config']['input_len']}-token prompts, tiny Llama, {m['cpu']}, {m['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: make the tiny model in a temp dir)")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds per load point")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--short-len", type=int, default=16, help="prompt length of the fixed-cost probe")
    ap.add_argument("--low-requests", type=int, default=20)
    ap.add_argument("--mid-requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine process")
    ap.add_argument("--skip-moderate", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.time()
    model, made = a.model, not a.model
    if made:
        model = tempfile.mkdtemp(prefix="bench-pd-model-")
        subprocess.run([DISAGG, "model", "make-tiny", "--out", model], check=True, stdout=subprocess.DEVNULL)
    res: dict = {"machine": machine_info(), "config": vars(a) | {"model": model}}
    threads = ["--torch-threads", str(a.threads)]
    env = {"OMP_NUM_THREADS": str(a.threads)}
    servers = {
        "mono": Serve(model, *threads, env=env, name="bench-pd"),
        "pd": Serve(model, "--local", *threads, env=env, name="bench-pd"),
    }
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_healthy()
        for s in servers.values():  # warm-up: first forwards, first transfer connections
            load(s.url, n=4, concurrency=2, input_len=a.input_len, output_len=a.output_len, seed=999)
        print("low load (concurrency 1)", flush=True)
        res["low"] = interleaved(servers, a, n=a.low_requests, concurrency=1, base_seed=1000)
        print(f"short prompts ({a.short_len} tokens, concurrency 1): the fixed cost of the P/D path", flush=True)
        res["short"] = interleaved(servers, a, n=a.low_requests, concurrency=1, base_seed=3000, input_len=a.short_len)
        if not a.skip_moderate:
            print("moderate load (concurrency 8)", flush=True)
            res["moderate"] = interleaved(servers, a, n=a.mid_requests, concurrency=8, base_seed=2000)
    finally:
        for s in servers.values():
            s.stop()
        if made:
            shutil.rmtree(model, ignore_errors=True)
    res["seconds"] = round(time.time() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pd.json").write_text(json.dumps(res, indent=2) + "\n")
    if "moderate" in res:
        plot(res, RESULTS / "pd.png")
    for key in ("low", "short", "moderate"):
        if key in res:
            r = res[key]
            mono, pd = r["median"]["mono"]["p50_ttft_ms"], r["median"]["pd"]["p50_ttft_ms"]
            print(
                f"{key}: TTFT p50 mono {mono:.1f} ms, pd {pd:.1f} ms"
                f" (x{r['ratio_pd_over_mono']['p50_ttft_ms']:.2f}); p90 x{r['ratio_pd_over_mono']['p90_ttft_ms']:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
