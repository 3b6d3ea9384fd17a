"""DP attention against plain tensor parallelism on this machine: the tiny DeepSeek-V3 (MLA) served by two ranks,
`--tp-size 2` against `--tp-size 2 --enable-dp-attention --dp-size 2` (and each with `--ep-size 2`).

What is measured, rounds interleaved (configurations in alternating order):
1. Decode throughput at concurrency 32 (`disagg bench serve`, 64 prompts of 128 random tokens in / 64 out).
2. The KV the instance holds: pages of every attention group (/stats), at the same `--max-total-tokens` per rank.
   Under TP both ranks cache the whole MLA latent of the same requests (the latent is replicated), so two ranks
   hold what one does; under DP attention each group caches its own requests, so two ranks hold twice as much.

What each costs: DP attention gathers both groups' tokens before every MLP (an all-gather over gloo here) and an
idle group still joins every forward; TP all-reduces every attention output. On GPUs these exchanges run over
NVLink, and the gain DP attention exists for (a latent cached once per group instead of once per rank, so more
requests fit) grows with the number of ranks.

Writes bench/results/dp_attention.json and dp_attention.png.  Usage: python bench/bench_dp_attention.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import DISAGG, RESULTS, Serve, machine_info  # noqa: E402
from disagg_worker.model.tiny import make_tiny  # noqa: E402

DP2 = ("--enable-dp-attention", "--dp-size", "2")
CONFIGS = {
    "tp2": ("--tp-size", "2"),
    "tp2_dp2": ("--tp-size", "2", *DP2),
    "tp2_ep2": ("--tp-size", "2", "--ep-size", "2"),
    "tp2_dp2_ep2": ("--tp-size", "2", "--ep-size", "2", *DP2),
}
POOL = ("--max-total-tokens", "8192")


def run(model: str, flags: tuple[str, ...], seed: int) -> dict:
    with Serve(model, *POOL, *flags, name="dp") as s:
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        load = ["--num-prompts", "64", "--max-concurrency", "32", "--input-len", "128", "--output-len", "64"]
        cmd = [DISAGG, "bench", "serve", "--base-url", s.url, *load, "--range-ratio", "1.0", "--seed", str(seed)]
        subprocess.run([*cmd, "--output", str(out)], check=True, stdout=subprocess.DEVNULL, env=s.env)
        with urllib.request.urlopen(f"{s.url}/stats", timeout=10) as r:
            st = json.loads(r.read())
        return {
            "tok_s": float(json.loads(out.read_text())["output_throughput"]),
            "kv_pages": st["pages_total"],
            "groups": len(st.get("groups", [])) or 1,
        }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(CONFIGS)
    labels = ["TP 2", "TP 2, DP attn 2", "TP 2 + EP 2", "TP 2 + EP 2, DP attn 2"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(labels, [res["throughput"][n]["median"] for n in names])
    axes[0].set_title("decode throughput, concurrency 32 (out tok/s)", fontsize=9)
    axes[1].bar(labels, [res["kv_tokens"][n] for n in names])
    axes[1].set_title("KV tokens the instance holds (same pool per rank)", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    m = res["machine"]
    fig.suptitle(f"tiny DeepSeek-V3 (MLA + MoE), {m['cpu']}, {m['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = str(make_tiny(Path(tempfile.mkdtemp(prefix="bench-dp-")) / "mla", arch="deepseek_v3"))
    runs: dict[str, list[dict]] = {n: [] for n in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]
        for name in order:
            runs[name].append(run(model, CONFIGS[name], seed=r))
        print(f"round {r}: " + ", ".join(f"{n} {runs[n][-1]['tok_s']:.1f} tok/s" for n in CONFIGS), flush=True)
    tput = {
        n: {"median": statistics.median(x["tok_s"] for x in v), "rounds": [x["tok_s"] for x in v]}
        for n, v in runs.items()
    }
    res = {
        "machine": machine_info(),
        "config": {**vars(args), "pool": POOL, "load": "64 prompts x 128 in / 64 out, concurrency 32"},
        "throughput": tput,
        "dp_over_tp": tput["tp2_dp2"]["median"] / tput["tp2"]["median"],
        "dp_ep_over_tp_ep": tput["tp2_dp2_ep2"]["median"] / tput["tp2_ep2"]["median"],
        # Pages of every group x page size; under TP the two ranks' pools hold the same tokens.
        "kv_tokens": {n: v[0]["kv_pages"] * 16 for n, v in runs.items()},
        "groups": {n: v[0]["groups"] for n, v in runs.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dp_attention.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "dp_attention.png")
    print(json.dumps({k: res[k] for k in ("throughput", "dp_over_tp", "dp_ep_over_tp_ep", "kv_tokens")}, indent=2))


if __name__ == "__main__":
    main()
