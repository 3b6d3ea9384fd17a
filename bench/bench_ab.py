"""A/B: the same `disagg serve` load against two checkouts of this repository, interleaved in one run.

A change that should leave performance alone (a refactor) is checked by pairing it against the commit
before it: each round starts `disagg serve` on the tiny model from checkout A and from checkout B (the
order alternates), loads it with `disagg bench serve` (256 prompts, 128 in / 64 out, concurrency 32)
and records output tokens/s. The result is B's median over A's, with both sides' spread: a ratio inside
the spread is run-to-run noise.

Run: `git worktree add /tmp/base <commit>` then
`.venv/bin/python bench/bench_ab.py --a /tmp/base --b . --rounds 4` (about 3 minutes on 2 cores).
Writes `bench/results/ab.json` and `bench/results/ab.png`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DISAGG, RESULTS, Serve, machine_info  # noqa: E402


def git_head(checkout: Path) -> str:
    out = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def one_run(model: str, checkout: Path, args: argparse.Namespace) -> float:
    """Output tokens/s of `disagg serve` from `checkout` under the bench load."""
    env = {"PYTHONPATH": f"{checkout / 'worker'}:{checkout / 'operator'}:{checkout / 'api'}"}
    with Serve(model, env=env, name="ab") as s:
        report = Path(tempfile.mkstemp(suffix=".json")[1])
        load = ["--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency)]
        load += ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--range-ratio", "1.0"]
        cmd = [DISAGG, "bench", "serve", "--base-url", s.url, *load, "--output", str(report)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=s.env)
        return float(json.loads(report.read_text())["output_throughput"])


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for i, side in enumerate(("a", "b")):
        runs = res[side]["output_tok_s"]
        ax.scatter([i] * len(runs), runs, alpha=0.6)
        ax.hlines(res[side]["median"], i - 0.2, i + 0.2)
    ax.set_xticks([0, 1], [f"A {res['a']['commit']}", f"B {res['b']['commit']}"])
    ax.set_ylabel("output tokens/s")
    m = res["machine"]
    ax.set_title(f"B/A median = {res['ratio_b_over_a']:.2f} ({m['cpu']}, {m['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", type=Path, required=True, help="checkout A (the baseline)")
    p.add_argument("--b", type=Path, default=Path("."), help="checkout B (the change)")
    p.add_argument("--model", default="", help="model dir (default: the tiny model, made in a temp dir)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    model = args.model or tempfile.mkdtemp(prefix="ab-tiny-")
    if not args.model:
        subprocess.run([DISAGG, "model", "make-tiny", "--out", model], check=True, stdout=subprocess.DEVNULL)
    runs: dict[str, list[float]] = {"a": [], "b": []}
    for rnd in range(args.rounds):
        for side in ("a", "b") if rnd % 2 == 0 else ("b", "a"):
            runs[side].append(one_run(model, getattr(args, side).resolve(), args))
            print(f"round {rnd} {side.upper()}: {runs[side][-1]:.0f} output tok/s", flush=True)
    res = {
        "benchmark": "disagg serve output tokens/s, checkout A vs B, interleaved rounds",
        "machine": machine_info(),
        "load": {k: getattr(args, k) for k in ("num_prompts", "concurrency", "input_len", "output_len")},
        **{
            side: {"commit": git_head(getattr(args, side)), "output_tok_s": v, "median": statistics.median(v)}
            for side, v in runs.items()
        },
    }
    res["ratio_b_over_a"] = res["b"]["median"] / res["a"]["median"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ab.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "ab.png")
    print(json.dumps({k: res[k] for k in ("a", "b", "ratio_b_over_a")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
