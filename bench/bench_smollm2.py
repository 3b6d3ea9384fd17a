"""Throughput on a real model: SmolLM2-135M-Instruct served by `disagg serve` against transformers on the same
prompts, weights and torch thread count, in one run on one machine.

- ours: `disagg serve --model DIR --torch-threads N` (DIR: the demo GGUF converted as `make serve` does it,
  float32) loaded by `disagg bench serve` at a fixed concurrency (default 32 requests in flight, 128
  prompt tokens in, 64 out, EOS ignored, streamed over HTTP);
- transformers generate: `model.generate` on the same prompts in batches of our concurrency (all prompts
  have the same length, so no padding), greedy, exactly 64 new tokens per row, in this process with
  `torch.set_num_threads(N)`;
- transformers generate_batch: its continuous batching with a paged KV cache
  (`generation/continuous_batching`), same prompts, greedy, 64 new tokens each, at most as many requests
  per batch as our concurrency and as many tokens per forward as our `--max-batch-tokens`. (Its
  defaults size the KV cache from free memory, 90% of the RAM on a CPU; here it gets 64 blocks of
  256 tokens, twice what the requests in flight need.) The target (>= 5x) is against this one.

The figure is output tokens per second over the whole load (prefill included) and the ratio of ours to
each baseline. Rounds alternate between the three (`--rounds`, default 2; medians; the latency
percentiles are those of our median round). `--dtype bfloat16` runs all in bfloat16. Run:
`.venv/bin/python bench/bench_smollm2.py` (about 4 minutes on a 2-core machine). Writes
`bench/results/smollm2.json` and `bench/results/smollm2.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from disagg_worker.bench import serve as serve_bench
from disagg_worker.config import SchedulerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DISAGG, LATENCY_KEYS, RESULTS, Serve, bench_args, machine_info, pick  # noqa: E402


def load_args(a: argparse.Namespace, url: str, seed: int, num_prompts: int = 0) -> argparse.Namespace:
    """One load of `disagg bench serve`: random token ids from its default range, drawn with `seed`."""
    return bench_args(
        url,
        num_prompts=num_prompts or a.num_prompts,
        concurrency=a.concurrency,
        input_len=a.input_len,
        output_len=a.output_len,
        seed=seed,
    )


def workload(a: argparse.Namespace, seed: int) -> list[list[int]]:
    """The prompts `disagg bench serve` sends with `seed`."""
    return [p for p, _ in serve_bench.make_workload(load_args(a, "", seed))]


class TransformersBatch:
    """transformers' continuous batching (`generate_batch`) on the same model, in this process."""

    def __init__(self, model: str, a: argparse.Namespace):
        from transformers import AutoModelForCausalLM
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        torch.set_num_threads(a.threads)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, a.dtype)).eval()
        blocks_per_request = -(-(a.input_len + a.output_len) // 256)  # its default page size: 256 tokens
        self.config = ContinuousBatchingConfig(
            max_requests_per_batch=a.concurrency,
            max_batch_tokens=SchedulerConfig.max_batch_tokens,
            num_blocks=2 * a.concurrency * blocks_per_request,
        )

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
        """(seconds, tokens generated) for all prompts at once, greedy."""
        from transformers import GenerationConfig

        # eos_token_id -1: never stop early, like our ignore_eos.
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        start = time.perf_counter()
        out = self.model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=self.config, warmup=False
        )
        return time.perf_counter() - start, sum(len(r.generated_tokens) for r in out.values())

    def describe(self) -> dict:
        import transformers

        return {
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "attn_implementation": self.model.config._attn_implementation,
            "continuous_batching": {
                "max_requests_per_batch": self.config.max_requests_per_batch,
                "max_batch_tokens": self.config.max_batch_tokens,
                "num_blocks": self.config.num_blocks,
            },
        }


class TransformersGenerate:
    """transformers' `generate`, batched: the prompts in batches of our concurrency (all of one length,
    so no padding), greedy, every row exactly `new_tokens` long."""

    def __init__(self, model: Any, a: argparse.Namespace):  # a transformers PreTrainedModel
        self.model, self.batch = model, a.concurrency

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
        """(seconds, tokens generated) for all prompts, one batch after the other."""
        start, made = time.perf_counter(), 0
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch):
                ids = torch.tensor(prompts[i : i + self.batch])
                out = self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                made += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return time.perf_counter() - start, made


def rates(runs: list[tuple[float, int]], loads: list[float]) -> dict:
    per_round = [n / t for t, n in runs]
    return {
        "output_tok_s": round(statistics.median(per_round), 1),
        "output_tok_s_rounds": [round(r, 1) for r in per_round],
        "duration_s_rounds": [round(t, 2) for t, _ in runs],
        "load_average_1min_before_rounds": loads,
    }


def measure(model: str, a: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Rounds alternate between our server and the two transformers baselines, so a slow phase of a shared
    machine hits all three. Each round has its own prompts (the same for all), so our prefix cache never
    holds one."""
    hf = TransformersBatch(model, a)
    gen = TransformersGenerate(hf.model, a)
    warm = workload(a, seed=1000)[:4]
    hf.run(warm, 4)
    gen.run(warm, 4)
    env = {"OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    flags = ("--torch-threads", str(a.threads), "--dtype", a.dtype)
    ours_runs, hf_runs, gen_runs, loads = [], [], [], []
    with Serve(model, *flags, env=env, name="bench-smollm2") as srv:
        asyncio.run(serve_bench.bench(load_args(a, srv.url, seed=1000, num_prompts=4)))  # warm-up
        for r in range(a.rounds):
            prompts = workload(a, seed=r)
            loads.append(round(os.getloadavg()[0], 2))
            ours_runs.append(asyncio.run(serve_bench.bench(load_args(a, srv.url, seed=r))))
            loads.append(round(os.getloadavg()[0], 2))
            gen_runs.append(gen.run(prompts, a.output_len))
            loads.append(round(os.getloadavg()[0], 2))
            hf_runs.append(hf.run(prompts, a.output_len))
    assert all(r["failed"] == 0 for r in ours_runs), [r.get("errors") for r in ours_runs]
    assert all(n == a.num_prompts * a.output_len for _, n in hf_runs + gen_runs), (hf_runs, gen_runs)
    mid = sorted(ours_runs, key=lambda r: r["output_throughput"])[len(ours_runs) // 2]
    ours = {
        "output_tok_s": round(statistics.median(r["output_throughput"] for r in ours_runs), 1),
        "output_tok_s_rounds": [round(r["output_throughput"], 1) for r in ours_runs],
        "request_s": round(mid["request_throughput"], 3),
        "duration_s": round(mid["duration_s"], 2),
        "torch_threads": a.threads,
        "load_average_1min_before_rounds": loads[::3],
        **pick(mid, *LATENCY_KEYS),
    }
    generate = {**rates(gen_runs, loads[1::3]), "batch_size": a.concurrency}
    return ours, generate, {**rates(hf_runs, loads[2::3]), **hf.describe()}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, m = res["config"], res["machine"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bars = [res[k]["output_tok_s"] for k in ("ours", "transformers_generate", "transformers_generate_batch")]
    labels = [
        f"disagg serve\n(concurrency {c['concurrency']})",
        f"transformers generate\n(batches of {c['concurrency']})",
        "transformers\ngenerate_batch",
    ]
    ax.bar(labels, bars, color=["tab:blue", "tab:gray", "silver"])
    for x, y in enumerate(bars):
        ax.text(x, y, f"{y:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tok/s")
    r = res["ratio"]
    ax.set_title(
        f"SmolLM2-135M-Instruct {c['dtype']}, {c['input_len']} in / {c['output_len']} out, "
        f"{c['threads']} torch thread(s)\n{r['generate']:.2f}x generate, {r['generate_batch']:.2f}x generate_batch",
        fontsize=10,
    )
    fig.suptitle(f"{m['cpu']} x{m['cores']}, load {m['load_average_at_start'][0]:.1f} at start", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def ratios(res: dict, key: str) -> tuple[float, list[float]]:
    """Our median output rate over a baseline's, and the same per round."""
    ours, theirs = res["ours"], res[key]
    rounds = zip(ours["output_tok_s_rounds"], theirs["output_tok_s_rounds"], strict=True)
    return round(ours["output_tok_s"] / theirs["output_tok_s"], 2), [round(o / t, 2) for o, t in rounds]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads on both sides")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute, both sides"
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved measurements of both sides (median)")
    p.add_argument("--model", default="", help="a converted SmolLM2 directory (default: convert the demo GGUF)")
    p.add_argument("--out", default="", help="default: bench/results/smollm2.json (smollm2-bfloat16.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}", flush=True)

    import transformers

    res: dict = {"machine": machine_info(transformers=transformers.__version__), "config": vars(a)}
    with tempfile.TemporaryDirectory(prefix="bench-smollm2-") as tmp:
        model = a.model or str(Path(tmp) / "SmolLM2-135M-Instruct")
        if not a.model:
            stage("convert the demo GGUF")
            subprocess.run([DISAGG, "model", "convert-gguf", "--out", model], check=True, stdout=subprocess.DEVNULL)
        stage(f"{a.rounds} rounds: disagg serve, transformers generate, transformers generate_batch")
        res["ours"], res["transformers_generate"], res["transformers_generate_batch"] = measure(model, a)
    res["ratio"], res["ratio_rounds"] = {}, {}
    for name in ("generate", "generate_batch"):
        res["ratio"][name], res["ratio_rounds"][name] = ratios(res, f"transformers_{name}")
    res["targets"] = {"throughput_ratio_vs_generate_batch_ge_5": res["ratio"]["generate_batch"] >= 5}
    res["machine"]["load_average_at_end"] = list(os.getloadavg())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out or RESULTS / ("smollm2.json" if a.dtype == "float32" else f"smollm2-{a.dtype}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print(json.dumps({k: res[k] for k in ("ratio", "ratio_rounds", "targets", "wall_s")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
