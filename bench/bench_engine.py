"""Benchmarks of one serving engine instance on the embedded tiny Llama model.

Three measurements, each compared against a baseline taken in the same run (ratios), because the
machines this runs on are small and shared:

1. throughput: `disagg serve` (default flags) loaded by `disagg bench serve` at a fixed concurrency,
   against Hugging Face `transformers` `generate` one request at a time, on the same prompts;
2. scheduler overhead over HTTP: time per scheduler step with `--forward noop` (everything but the
   model) divided by the time per decode step with the real model, same batch, same load;
3. an in-process microbenchmark (Engine + Stepper, no HTTP): decode steps/s for noop/model x overlap
   on/off, plus a per-phase breakdown and a cProfile of the noop step.

Run: `.venv/bin/python bench/bench_engine.py` (about 3-5 minutes on 2 cores). Writes
`bench/results/engine.json` and `bench/results/engine.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from disagg_worker.bench import serve as serve_bench
from disagg_worker.config import EngineConfig, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DISAGG, LATENCY_KEYS, RESULTS, Serve, bench_args, machine_info, pick  # noqa: E402

DEFAULT_THREADS = torch.get_num_threads()


# ---- 1. throughput vs transformers --------------------------------------------------------------
def ours_throughput(model: str, a: argparse.Namespace, env: dict) -> dict:
    def ns(url: str, n: int) -> argparse.Namespace:
        return bench_args(url, num_prompts=n, concurrency=a.concurrency, input_len=a.input_len, output_len=a.output_len)

    with Serve(model, env=env, name="bench-engine") as srv:
        asyncio.run(serve_bench.bench(ns(srv.url, 8)))  # warm-up
        runs = [asyncio.run(serve_bench.bench(ns(srv.url, a.num_prompts))) for _ in range(a.rounds)]
    best = sorted(runs, key=lambda r: r["output_throughput"])[len(runs) // 2]  # the median round
    assert all(r["failed"] == 0 for r in runs), [r.get("errors") for r in runs]
    return {
        "output_tok_s": round(best["output_throughput"], 1),
        "output_tok_s_rounds": [round(r["output_throughput"], 1) for r in runs],
        "request_s": round(best["request_throughput"], 3),
        "input_tok_s": round(best["input_throughput"], 1),
        "duration_s": round(best["duration_s"], 2),
        **pick(best, *LATENCY_KEYS),
    }


def transformers_throughput(model: str, a: argparse.Namespace, threads: int, num_prompts: int) -> dict:
    from transformers import AutoModelForCausalLM

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _hf_generate(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), a, num_prompts) | {
            "torch_threads": threads
        }
    finally:
        torch.set_num_threads(before)


def _hf_generate(hf: torch.nn.Module, a: argparse.Namespace, num_prompts: int) -> dict:
    ns = bench_args("", num_prompts=a.num_prompts, concurrency=1, input_len=a.input_len, output_len=a.output_len)
    prompts = [p for p, _ in serve_bench.make_workload(ns)][:num_prompts]
    kw = {
        "do_sample": False,
        "max_new_tokens": a.output_len,
        "min_new_tokens": a.output_len,
        "pad_token_id": hf.config.eos_token_id,
    }
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        produced, start = 0, time.perf_counter()
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kw)
            produced += out.shape[1] - len(p)
        elapsed = time.perf_counter() - start
    return {
        "output_tok_s": round(produced / elapsed, 1),
        "prompts": len(prompts),
        "output_tokens": produced,
        "duration_s": round(elapsed, 2),
    }


def compare_throughput(ours: dict, model: str, a: argparse.Namespace) -> dict:
    """The baseline is transformers at its faster thread count: ours, or torch's default on a few prompts."""
    runs = [transformers_throughput(model, a, torch.get_num_threads(), a.hf_prompts)]
    if DEFAULT_THREADS != torch.get_num_threads():
        runs.append(transformers_throughput(model, a, DEFAULT_THREADS, max(1, a.hf_prompts // 8)))
    hf = max(runs, key=lambda r: r["output_tok_s"])
    return {
        "ours": ours,
        "transformers": hf,
        "transformers_runs": runs,
        "ratio": round(ours["output_tok_s"] / hf["output_tok_s"], 2),
    }


# ---- 2. scheduler overhead over HTTP ------------------------------------------------------------
async def load_and_watch(ns: argparse.Namespace, batch: int) -> tuple[dict, list[dict]]:
    """Run the load while sampling /stats; returns the bench report and the samples at full batch."""
    samples: list[dict] = []
    done = asyncio.Event()

    async def watch() -> None:
        async with aiohttp.ClientSession() as s:
            while not done.is_set():
                async with s.get(f"{ns.base_url}/stats") as resp:
                    st = await resp.json()
                if st["running"] == batch and st["waiting"] == 0 and (not samples or st["time"] != samples[-1]["time"]):
                    samples.append(st)
                await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        report = await serve_bench.bench(ns)
    finally:
        done.set()
        await watcher
    return report, samples


def step_ms(samples: list[dict]) -> float | None:
    """Scheduler time per step between the first and last full-batch reports (about 0.5 s apart each).

    The first report may come before the two prefill steps; against hundreds of decode steps that
    is noise.
    """
    if len(samples) < 2:
        return None
    first, last = samples[0], samples[-1]
    steps = last["step_count"] - first["step_count"]
    return (last["time"] - first["time"]) / steps * 1000 if steps > 0 else None


def http_overhead(model: str, a: argparse.Namespace, env: dict) -> dict:
    flags = ("--max-total-tokens", str(a.batch * (a.input_len + a.overhead_output_len + 64)))

    def ns(url: str) -> argparse.Namespace:
        return bench_args(
            url, num_prompts=a.batch, concurrency=a.batch, input_len=a.input_len, output_len=a.overhead_output_len
        )

    per: dict[str, dict[str, list]] = {f: {"step_ms": [], "p50_itl_ms": []} for f in ("noop", "model")}
    with (
        Serve(model, "--forward", "noop", *flags, env=env, name="bench-engine") as noop,
        Serve(model, *flags, env=env, name="bench-engine") as real,
    ):
        for srv in (noop, real):
            asyncio.run(
                serve_bench.bench(bench_args(srv.url, num_prompts=4, concurrency=4, input_len=16, output_len=8))
            )
        for _ in range(a.rounds):  # alternate, so slow phases of a shared machine hit both
            for fwd, srv in (("noop", noop), ("model", real)):
                # A noop load lasts a few stats reports only; it is cheap to repeat until two land in it.
                for _ in range(4 if fwd == "noop" else 1):
                    report, samples = asyncio.run(load_and_watch(ns(srv.url), a.batch))
                    if step_ms(samples) is not None:
                        break
                per[fwd]["step_ms"].append(step_ms(samples))
                per[fwd]["p50_itl_ms"].append(report["p50_itl_ms"])
    out = {}
    for fwd, d in per.items():
        steps = [x for x in d["step_ms"] if x is not None]
        out[fwd] = {
            "step_ms": round(statistics.median(steps), 3) if steps else None,
            "step_ms_rounds": [round(x, 3) if x else None for x in d["step_ms"]],
            "p50_itl_ms": round(statistics.median(d["p50_itl_ms"]), 3),
        }
    if out["noop"]["step_ms"] and out["model"]["step_ms"]:
        out["overhead_ratio_stats"] = round(out["noop"]["step_ms"] / out["model"]["step_ms"], 4)
    out["overhead_ratio_itl"] = round(out["noop"]["p50_itl_ms"] / out["model"]["p50_itl_ms"], 4)
    return out


# ---- 3. in-process microbenchmark ---------------------------------------------------------------
def make_engine(model: str, forward: str, overlap: bool, tokens: int) -> Engine:
    from disagg_worker.config import CacheConfig

    cfg = EngineConfig(
        model_path=model,
        forward=forward,
        cache=CacheConfig(max_total_tokens=tokens),
        scheduler=SchedulerConfig(enable_overlap=overlap),
    )
    return load_engine(cfg)


def add_requests(engine: Engine, n: int, input_len: int, output_len: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(n):
        engine.handle(msg.GenerateReq(str(i), [rng.randrange(10, 1000) for _ in range(input_len)], params))


def decode_steps_per_s(model: str, forward: str, overlap: bool, a: argparse.Namespace) -> float:
    """Steps/s while all requests decode: from the first step after every prefill to the first finish."""
    engine = make_engine(model, forward, overlap, a.batch * (a.input_len + a.micro_output_len + 64))
    add_requests(engine, a.batch, a.input_len, a.micro_output_len)
    assert engine.cfg.overlap == overlap  # the executor's: launched steps overlap
    sched, stepper = engine.scheduler, Stepper(engine)
    start = end = None
    while stepper.busy:
        stepper.step()
        engine.take_outputs()
        if start is None:
            if len(sched.running) == a.batch and min(len(r.output_ids) for r in sched.running) >= 2:
                start = (time.perf_counter(), sched.step_count)
        elif len(sched.running) < a.batch:
            end = (time.perf_counter(), sched.step_count)
            break
    stepper.close()
    return (end[1] - start[1]) / (end[0] - start[0])


def microbench(model: str, a: argparse.Namespace) -> dict:
    configs = [(f, o) for f in ("noop", "model") for o in (True, False)]
    rates: dict[tuple[str, bool], list[float]] = {c: [] for c in configs}
    for _ in range(a.rounds):  # interleaved rounds, median per configuration
        for fwd, overlap in configs:
            rates[(fwd, overlap)].append(decode_steps_per_s(model, fwd, overlap, a))
    out = {}
    for (fwd, overlap), r in rates.items():
        med = statistics.median(r)
        out[f"{fwd}_overlap_{'on' if overlap else 'off'}"] = {
            "steps_s": round(med, 1),
            "step_ms": round(1000 / med, 3),
            "steps_s_rounds": [round(x, 1) for x in r],
        }
    for ov in ("on", "off"):
        out[f"overhead_ratio_overlap_{ov}"] = round(
            out[f"model_overlap_{ov}"]["steps_s"] / out[f"noop_overlap_{ov}"]["steps_s"], 4
        )
    return out


def threads_effect(model: str, a: argparse.Namespace) -> dict:
    """One round of the overlapped noop and model steps with torch's default intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        rates = {f: decode_steps_per_s(model, f, True, a) for f in ("noop", "model")}
    finally:
        torch.set_num_threads(before)
    return {
        "torch_threads": DEFAULT_THREADS,
        **{f"{f}_overlap_on": {"steps_s": round(r, 1), "step_ms": round(1000 / r, 3)} for f, r in rates.items()},
    }


def phase_breakdown(model: str, a: argparse.Namespace, steps: int = 150) -> dict:
    """Synchronous noop decode steps: ms per step in schedule / run (zeros + sampler) / process."""
    engine = make_engine(model, "noop", False, a.batch * (a.input_len + a.micro_output_len + 64))
    add_requests(engine, a.batch, a.input_len, steps + 20)
    tot = {"schedule": 0.0, "run": 0.0, "process": 0.0}
    for i in range(steps + 5):
        t0 = time.perf_counter()
        batch = engine.schedule()
        t1 = time.perf_counter()
        result = engine.run(batch)
        t2 = time.perf_counter()
        engine.process(batch, result)
        engine.take_outputs()
        t3 = time.perf_counter()
        if i >= 5:
            for k, dt in zip(tot, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                tot[k] += dt
    phases = {k: round(v / steps * 1000, 3) for k, v in tot.items()}
    profile = profile_noop(model, a)
    return {"ms_per_step": phases, "cprofile_top_tottime": profile}


def profile_noop(model: str, a: argparse.Namespace, steps: int = 100) -> list[dict]:
    engine = make_engine(model, "noop", False, a.batch * (a.input_len + a.micro_output_len + 64))
    add_requests(engine, a.batch, a.input_len, steps + 20)

    def step() -> None:
        batch = engine.schedule()
        engine.process(batch, engine.run(batch))
        engine.take_outputs()

    for _ in range(5):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]
    return [
        {
            "function": f"{Path(f).name}:{line}({name})",
            "calls_per_step": round(cc / steps, 1),
            "tottime_ms_per_step": round(tt / steps * 1000, 3),
            "cumtime_ms_per_step": round(ct / steps * 1000, 3),
        }
        for (f, line, name), (cc, _nc, tt, ct, _callers) in rows
    ]


# ---- report -------------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    tp = res["throughput"]
    ax[0].bar(
        [f"disagg serve\n(concurrency {res['config']['concurrency']})", "transformers\n(one at a time)"],
        [tp["ours"]["output_tok_s"], tp["transformers"]["output_tok_s"]],
        color=["tab:blue", "tab:gray"],
    )
    ax[0].set_title(f"output tok/s ({tp['ratio']:.1f}x)")
    ho = res["http_overhead"]
    ax[1].bar(
        ["noop", "model"], [ho["noop"]["step_ms"] or 0, ho["model"]["step_ms"] or 0], color=["tab:orange", "tab:blue"]
    )
    ax[1].set_title(f"HTTP server: ms per step at batch {res['config']['batch']}")
    mb = res["microbench"]
    xs = range(2)
    for k, (ov, color) in enumerate((("on", "tab:green"), ("off", "tab:red"))):
        ax[2].bar(
            [x + 0.4 * k for x in xs],
            [mb[f"{f}_overlap_{ov}"]["step_ms"] for f in ("noop", "model")],
            width=0.4,
            label=f"overlap {ov}",
            color=color,
        )
    ax[2].set_xticks([x + 0.2 for x in xs], ["noop", "model"])
    ax[2].set_title("in-process: ms per decode step")
    ax[2].legend()
    fig.suptitle(f"disagg engine, tiny Llama, {res['machine']['cpu']} x{res['machine']['cores']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--hf-prompts", type=int, default=16, help="prompts run through transformers")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--batch", type=int, default=32, help="concurrent requests for the overhead benchmarks")
    p.add_argument("--overhead-output-len", type=int, default=384)
    p.add_argument("--micro-output-len", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3, help="repetitions per measurement (median or best)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in every process (server, scheduler, transformers); 0 keeps torch's default",
    )
    p.add_argument("--out", default=str(RESULTS / "engine.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    t0 = time.perf_counter()

    def stage(name: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {name}", flush=True)

    env = {"TOKENIZERS_PARALLELISM": "false"}
    if a.threads:
        torch.set_num_threads(a.threads)
        env["OMP_NUM_THREADS"] = str(a.threads)
    config = {**vars(a), "torch_threads": torch.get_num_threads(), "torch_default_threads": DEFAULT_THREADS}
    import transformers

    res: dict = {"machine": machine_info(transformers=transformers.__version__), "config": config}
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        model = str(Path(tmp) / "tiny-llama")
        subprocess.run([DISAGG, "model", "make-tiny", "--out", model], check=True, stdout=subprocess.DEVNULL)
        stage("throughput: disagg serve")
        ours = ours_throughput(model, a, env)
        stage("throughput: transformers")
        res["throughput"] = compare_throughput(ours, model, a)
        stage("scheduler overhead over HTTP")
        res["http_overhead"] = http_overhead(model, a, env)
        stage("in-process microbenchmark")
        res["microbench"] = microbench(model, a)
        if DEFAULT_THREADS != torch.get_num_threads():
            stage("in-process microbenchmark at torch's default thread count")
            res["microbench_default_threads"] = threads_effect(model, a)
        stage("noop step breakdown and profile")
        res["noop_profile"] = phase_breakdown(model, a)
    res["machine"]["load_average_at_end"] = list(os.getloadavg())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    res["targets"] = {
        "throughput_ratio_ge_5": res["throughput"]["ratio"] >= 5,
        "http_overhead_le_10pct": (res["http_overhead"].get("overhead_ratio_stats") or 1) <= 0.10,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print(json.dumps({k: res[k] for k in ("throughput", "http_overhead", "microbench", "targets")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
