"""What tensor and pipeline parallelism cost per step on the tiny model, as shares of the step.

Each configuration runs its ranks as processes (gloo on this CPU machine), with the engine's own
pieces: `ranks.dist.Comm`, each rank's shard from `model.loader.load_model`, its paged KV pool,
and the engine's hand-off (`Comm.post_to`/`recv_from`: a pickled header and the hidden states).
A batch of requests is prefilled, then decoded step after step, each step waiting for the last
stage's logits as a decode step does (its next input is the token they give). Every rank times
its forward and, inside it, its all-reduces; the first rank times the whole step. The stage
hand-off is what the step takes beyond its stages' forwards: pickling the plan, moving the hidden
states to the next stage and the logits back.

On this 2-core machine the ranks compete for the cores, so the ratios say how much of a step the
communication takes here, not what a speed-up would be on separate devices.

    python bench/bench_parallel.py            # writes bench/results/parallel.{json,png}
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, free_port, machine_info  # noqa: E402
from disagg_worker.config import CacheConfig, EngineConfig  # noqa: E402
from disagg_worker.engine.batch import build_forward  # noqa: E402
from disagg_worker.engine.engine import build_kv_pool  # noqa: E402
from disagg_worker.engine.request import Req  # noqa: E402
from disagg_worker.engine.sampling import SamplingParams  # noqa: E402
from disagg_worker.mem.allocator import PageAllocator, pages_for  # noqa: E402
from disagg_worker.model.loader import load_model  # noqa: E402
from disagg_worker.model.parallel import Shard  # noqa: E402
from disagg_worker.model.tiny import make_tiny  # noqa: E402
from disagg_worker.ranks.dist import Comm, RankAddress  # noqa: E402

CONFIGS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)


class Timed:
    """Seconds spent inside a callable, summed."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kw)
        finally:
            self.seconds += time.perf_counter() - t0


def rank_main(rank: int, tp: int, pp: int, port: int, model: str, a: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    shard = Shard(rank % tp, tp, rank // tp, pp)
    comm: Comm | None = Comm(shard, RankAddress("127.0.0.1", port), "cpu") if tp * pp > 1 else None
    reduce = Timed(comm.all_reduce) if comm is not None else Timed(lambda x: x)
    model_, cfg = load_model(model, torch.float32, "cpu", shard, reduce)
    ecfg = EngineConfig(model_path=model, cache=CacheConfig(page_size=16, max_total_tokens=a.batch * 1024))
    pool = build_kv_pool(ecfg, cfg, shard)
    alloc = PageAllocator(pool.num_pages)
    params = SamplingParams(max_new_tokens=a.steps + 1)
    reqs = [Req(rid=str(i), prompt_ids=list(range(10, 10 + a.context)), params=params) for i in range(a.batch)]
    for r in reqs:
        r.pages = alloc.alloc(pages_for(a.context + a.steps + 1, 16)) or []
    prev, nxt, last = shard.world_rank - tp, shard.world_rank + tp, (pp - 1) * tp
    forward = 0.0

    def step(extend: list[int]) -> None:
        nonlocal forward
        fwd = build_forward(reqs, extend, 16)
        hidden = None
        if not shard.first_stage and comm is not None:
            _, hidden = comm.recv_from(prev)
        t0 = time.perf_counter()
        out_ = model_(fwd, pool, hidden)
        forward += time.perf_counter() - t0
        if comm is not None and pp > 1:
            if not shard.last_stage:
                comm.post_to(nxt, {"plan": fwd}, out_).wait()
            elif shard.tp_rank == 0:
                comm.send_to(0, {"logits": True}, out_)
            if shard.world_rank == 0:
                comm.recv_from(last)
        for r, n in zip(reqs, extend, strict=True):
            r.num_computed += n

    step([a.context] * a.batch)  # prefill
    for r in reqs:
        r.output_ids.append(1)
    reduce.seconds, forward = 0.0, 0.0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step([1] * a.batch)
        for r in reqs:
            r.output_ids.append(1)
    total = time.perf_counter() - t0
    result = {"rank": rank, "step_ms": total / a.steps * 1000, "allreduce_ms": reduce.seconds / a.steps * 1000}
    result["forward_ms"] = forward / a.steps * 1000
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if comm is not None:
        comm.close()


def run_config(tp: int, pp: int, model: str, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, tp, pp, port, model, a, out)) for r in range(tp * pp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"a rank of tp={tp} pp={pp} exited with {p.exitcode}")
        ranks = [json.loads(f.read_text()) for f in sorted(Path(out).glob("rank*.json"))]
    step = next(r["step_ms"] for r in ranks if r["rank"] == 0)
    allreduce = statistics.fmean(r["allreduce_ms"] for r in ranks)
    stages = [max(r["forward_ms"] for r in ranks if r["rank"] // tp == k) for k in range(pp)]
    handoff = max(0.0, step - sum(stages)) if pp > 1 else 0.0
    return {
        "tp": tp,
        "pp": pp,
        "step_ms": round(step, 3),
        "stage_forward_ms": [round(x, 3) for x in stages],
        "allreduce_ms": round(allreduce, 3),
        "handoff_ms": round(handoff, 3),
        "allreduce_share": round(allreduce / step, 3),
        "handoff_share": round(handoff / step, 3),
        "ranks": ranks,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"TP={r['tp']} PP={r['pp']}" for r in results]
    parts = {
        "all-reduce": [r["allreduce_share"] * 100 for r in results],
        "stage hand-off": [r["handoff_share"] * 100 for r in results],
    }
    rest = [100 - sum(v) for v in zip(*parts.values(), strict=True)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, rest, label="compute and the rest")
    bottom = rest
    for name, vals in parts.items():
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, r in enumerate(results):
        ax.text(i, 101, f"{r['step_ms']:.1f} ms", ha="center", fontsize=8)
    ax.set_ylabel("% of a decode step")
    ax.set_ylim(0, 110)
    ax.set_title("Decode step on the tiny model, batch of requests, gloo on 2 CPU cores")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_tiny(Path(tmp) / "tiny"))
        results = [run_config(tp, pp, model, a) for tp, pp in CONFIGS]
    RESULTS.mkdir(exist_ok=True)
    report = {
        "benchmark": "parallel",
        "machine": machine_info(backend="gloo"),
        "workload": {"model": "tiny (4 layers, hidden 128, 4 heads, 2 KV heads)", **vars(a)},
        "configs": results,
    }
    (RESULTS / "parallel.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, RESULTS / "parallel.png")
    for r in results:
        print(
            f"TP={r['tp']} PP={r['pp']}: step {r['step_ms']:.2f} ms, all-reduce {r['allreduce_share']:.0%}, "
            f"stage hand-off {r['handoff_share']:.0%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
