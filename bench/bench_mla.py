"""DeepSeek-class serving on this machine: what an MLA latent saves in KV bytes and transfer time against a
grouped-query model of the same hidden size, and what expert parallelism costs on a CPU.

1. KV bytes per token, exact from the configs: the tiny DeepSeek-V3 (MLA, latent 32 + 16) against the tiny
   Llama (GQA, 2 KV heads of 32), both hidden 128, 4 layers, float32; and the real shapes (DeepSeek-V3's
   576-value latent in bfloat16 against the per-head K/V it replaces and against Llama-3.1-70B's GQA).
2. KV transfer per request through real P/D stacks (router + prefill + decode processes, Mooncake TCP on
   loopback): `--requests` prompts of `--prompt-len` random tokens (one prefill chunk), one at a time,
   each model's stack in turn for `--rounds` rounds; bytes and seconds from prefill's own transfer
   metrics (disagg_kv_transfer_bytes_total, disagg_kv_transfer_seconds), router pairing probes off.
3. Decode throughput at concurrency 32 on the tiny DeepSeek-V3, `--tp-size 2` against `--tp-size 2
   --ep-size 2` (`disagg bench serve`, 64 prompts of 128 in / 64 out), rounds interleaved.

Writes bench/results/mla.json and mla.png.  Usage: python bench/bench_mla.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import DISAGG, RESULTS, Serve, machine_info  # noqa: E402
from disagg_worker.model.config import ModelConfig  # noqa: E402
from disagg_worker.model.tiny import make_tiny  # noqa: E402
from tests.integration.procs import PDStack  # noqa: E402

# One prefill chunk per prompt: the whole prompt's pages go in one send after the forward, so a transfer's
# span (first send to all writes landed) is the transfer alone, not the forward of later chunks.
PAGE_FLAGS = ("--page-size", "16", "--max-total-tokens", "16384", "--chunk-size", "2048")


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes the KV cache holds per token over all layers: the latent (MLA) or K and V of each KV head."""
    per_layer = cfg.kv_head_dim * cfg.kv_num_heads * (1 if cfg.mla else 2)
    return cfg.num_layers * per_layer * itemsize


def real_shapes() -> dict:
    from tests.unit.test_model_moe import DEEPSEEK_V3

    v3 = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert v3.mla is not None
    as_mha = v3.num_layers * v3.num_heads * (v3.mla.qk_head_dim + v3.mla.v_head_dim) * 2
    llama70 = 80 * 8 * 128 * 2 * 2
    return {
        "deepseek_v3_mla_bf16": kv_bytes_per_token(v3, 2),
        "deepseek_v3_if_per_head_kv_bf16": as_mha,
        "llama_3_1_70b_gqa_bf16": llama70,
    }


def metric_sum(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def post(url: str, ids: list[int]) -> None:
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def transfer_round(model: str, args: argparse.Namespace, seed: int) -> dict:
    """Mean bytes and seconds of one request's KV transfer through a fresh P/D stack."""
    stack = PDStack(model, *PAGE_FLAGS, router_flags=("--verify-interval", "0")).wait_healthy()
    try:
        rng = random.Random(seed)
        for _ in range(args.requests):
            post(stack.router.url, [rng.randrange(10, 2000) for _ in range(args.prompt_len)])
        time.sleep(1.0)  # counted just after each transfer's Success
        n = metric_sum(stack.prefill.url, "disagg_kv_transfer_seconds_count")
        return {
            "bytes_per_request": metric_sum(stack.prefill.url, "disagg_kv_transfer_bytes_total") / n,
            "seconds_per_request": metric_sum(stack.prefill.url, "disagg_kv_transfer_seconds_sum") / n,
        }
    finally:
        stack.stop()


def throughput(model: str, flags: tuple[str, ...], seed: int) -> float:
    with Serve(model, *flags, name="mla") as s:
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        load = ["--num-prompts", "64", "--max-concurrency", "32", "--input-len", "128", "--output-len", "64"]
        cmd = [DISAGG, "bench", "serve", "--base-url", s.url, *load, "--range-ratio", "1.0", "--seed", str(seed)]
        subprocess.run([*cmd, "--output", str(out)], check=True, stdout=subprocess.DEVNULL, env=s.env)
        return float(json.loads(out.read_text())["output_throughput"])


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    t = res["kv_bytes_per_token"]
    axes[0].bar(["tiny GQA", "tiny MLA"], [t["tiny_gqa_fp32"], t["tiny_mla_fp32"]])
    axes[0].set_title("KV bytes per token (hidden 128, 4 layers)", fontsize=9)
    tr = res["transfer"]
    axes[1].bar(["GQA", "MLA"], [tr["gqa"]["median_ms"], tr["mla"]["median_ms"]])
    axes[1].set_title(f"KV transfer per {res['config']['prompt_len']}-token request (ms)", fontsize=9)
    th = res["throughput"]
    axes[2].bar(["TP 2", "TP 2 + EP 2"], [th["tp2"]["median"], th["tp2_ep2"]["median"]])
    axes[2].set_title("decode throughput, concurrency 32 (out tok/s)", fontsize=9)
    m = res["machine"]
    fig.suptitle(f"{m['cpu']}, {m['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-mla-"))
    mla = str(make_tiny(work / "mla", arch="deepseek_v3"))
    gqa = str(make_tiny(work / "gqa"))
    cfg_mla, cfg_gqa = ModelConfig.from_hf_dir(mla), ModelConfig.from_hf_dir(gqa)
    res: dict = {
        "machine": machine_info(),
        "config": vars(args),
        "kv_bytes_per_token": {
            "tiny_mla_fp32": kv_bytes_per_token(cfg_mla, 4),
            "tiny_gqa_fp32": kv_bytes_per_token(cfg_gqa, 4),
            **real_shapes(),
        },
    }
    runs: dict[str, list[dict]] = {"mla": [], "gqa": []}
    tput: dict[str, list[float]] = {"tp2": [], "tp2_ep2": []}
    for r in range(args.rounds):
        order = [("mla", mla), ("gqa", gqa)] if r % 2 == 0 else [("gqa", gqa), ("mla", mla)]
        for name, model in order:
            runs[name].append(transfer_round(model, args, seed=r))
        configs = [("tp2", ("--tp-size", "2")), ("tp2_ep2", ("--tp-size", "2", "--ep-size", "2"))]
        for name, flags in configs if r % 2 == 0 else configs[::-1]:
            tput[name].append(throughput(mla, flags, seed=r))
        print(
            f"round {r}: transfer {runs['mla'][-1]} / {runs['gqa'][-1]}; tok/s {tput['tp2'][-1]:.1f} / "
            f"{tput['tp2_ep2'][-1]:.1f}",
            flush=True,
        )
    res["transfer"] = {
        k: {
            "bytes_per_request": v[0]["bytes_per_request"],
            "median_ms": statistics.median(x["seconds_per_request"] for x in v) * 1e3,
            "rounds_ms": [x["seconds_per_request"] * 1e3 for x in v],
        }
        for k, v in runs.items()
    }
    res["transfer"]["mla_over_gqa_bytes"] = (
        res["transfer"]["mla"]["bytes_per_request"] / res["transfer"]["gqa"]["bytes_per_request"]
    )
    res["transfer"]["mla_over_gqa_time"] = res["transfer"]["mla"]["median_ms"] / res["transfer"]["gqa"]["median_ms"]
    res["throughput"] = {k: {"median": statistics.median(v), "rounds": v} for k, v in tput.items()}
    res["throughput"]["ep_over_tp"] = res["throughput"]["tp2_ep2"]["median"] / res["throughput"]["tp2"]["median"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mla.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "mla.png")
    print(json.dumps({k: res[k] for k in ("kv_bytes_per_token", "transfer", "throughput")}, indent=2))


if __name__ == "__main__":
    main()
