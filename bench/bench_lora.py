"""LoRA adapters' cost: SmolLM2-135M-Instruct served by `disagg serve` with four adapters resident, the same
prompts asked of the base model alone and of the four adapters mixed in every batch, in one run.

Four adapters of rank 16 on every projection PEFT targets in a Llama (q/k/v/o, gate/up/down), made by PEFT on
the converted model with random non-zero weights (there is no hub here; what a trained adapter's weights are
does not change its cost), served with `--max-loras 4` (all resident: what is measured is the batched delta, not
loading). 32 completions at once (default), `max_tokens` 64, greedy, EOS ignored so every answer is as long:
once all for the base model, once each request for adapter i % 4. Rounds alternate between the two
(`--rounds`, default 2; medians). The figure is output tokens per second over the whole load (completion tokens /
wall time, prefill included) and the ratio adapters / base. Run: `.venv/bin/python bench/bench_lora.py` (a few
minutes on 2 cores). Writes `bench/results/lora.json` and `bench/results/lora.png`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the adapters are made as the tests make theirs (tests/lora_adapters.py)
from common import DISAGG, RESULTS, Serve, machine_info  # noqa: E402

SERVED = "smollm2"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "the first snow", "a long train ride"]


def prompts(n: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}, part {i}." for i in range(n)]


def one(url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    out = r.json()
    if out["model"] != model:
        raise SystemExit(f"asked for {model}, answered by {out['model']}")
    return out["usage"]["completion_tokens"]


def load(url: str, asks: list[tuple[str, str]], max_tokens: int) -> float:
    """Output tokens per second of every (model, prompt) of `asks` at once."""
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(asks)) as pool:
        tokens = sum(pool.map(lambda a: one(url, a[0], a[1], max_tokens), asks))
    if tokens != len(asks) * max_tokens:
        raise SystemExit(f"{tokens} tokens for {len(asks)} answers of {max_tokens}: an answer ended early")
    return tokens / (time.perf_counter() - start)


def make_adapters(model: str, out: Path, n: int, rank: int) -> dict[str, Path]:
    from tests.lora_adapters import write_adapter

    return {
        f"lora{i}": write_adapter(model, out / f"lora{i}", TARGETS, r=rank, alpha=2 * rank, seed=i) for i in range(n)
    }


def measure(model: str, adapters: dict[str, Path], a: argparse.Namespace) -> dict:
    texts = prompts(a.num_prompts)
    names = list(adapters)
    base = [(SERVED, t) for t in texts]
    mixed = [(names[i % len(names)], t) for i, t in enumerate(texts)]
    env = {"OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    modules = [f"{name}={path}" for name, path in adapters.items()]
    flags = ["--served-model-name", SERVED, "--torch-threads", str(a.threads), "--lora-modules", *modules]
    flags += ["--max-loras", str(len(adapters)), "--max-lora-rank", str(a.rank)]
    runs: dict[str, list[float]] = {"base": [], "adapters": []}
    with Serve(model, *flags, env=env, name="bench-lora") as srv:
        load(srv.url, base[:4], 8)  # warm-up
        load(srv.url, mixed[:4], 8)
        for _ in range(a.rounds):
            runs["base"].append(load(srv.url, base, a.max_tokens))
            runs["adapters"].append(load(srv.url, mixed, a.max_tokens))
    return {
        k: {"output_tok_s": round(statistics.median(v), 1), "output_tok_s_rounds": [round(x, 1) for x in v]}
        for k, v in runs.items()
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, m = res["config"], res["machine"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = [res["base"]["output_tok_s"], res["adapters"]["output_tok_s"]]
    labels = ["base model alone", f"{c['adapters']} adapters mixed\n(rank {c['rank']}, all projections)"]
    ax.bar(labels, bars, color=["tab:gray", "tab:blue"])
    for x, y in enumerate(bars):
        ax.text(x, y, f"{y:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tok/s")
    ax.set_title(
        f"SmolLM2-135M-Instruct, {c['num_prompts']} at once, {c['max_tokens']} tokens each: {res['ratio']:.2f}x",
        fontsize=10,
    )
    fig.suptitle(f"{m['cpu']} x{m['cores']}, load {m['load_average_at_start'][0]:.1f} at start", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help="a converted SmolLM2 directory (default: convert the demo GGUF)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    res: dict = {"machine": machine_info(), "config": vars(a)}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        model = a.model or str(Path(tmp) / "SmolLM2-135M-Instruct")
        if not a.model:
            subprocess.run([DISAGG, "model", "convert-gguf", "--out", model], check=True, stdout=subprocess.DEVNULL)
        adapters = make_adapters(model, Path(tmp), a.adapters, a.rank)
        res.update(measure(model, adapters, a))
    res["ratio"] = round(res["adapters"]["output_tok_s"] / res["base"]["output_tok_s"], 3)
    res["targets"] = {"adapters_over_base_ge_0.7": res["ratio"] >= 0.7}
    res["machine"]["load_average_at_end"] = list(os.getloadavg())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    out = RESULTS / "lora.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "lora.png")
    print(json.dumps({k: res[k] for k in ("base", "adapters", "ratio", "targets")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
