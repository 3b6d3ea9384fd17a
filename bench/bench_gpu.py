"""The engine on one GPU, each figure a ratio to a limit measured in the same run, on the random model of a real
model's shape (`disagg model make-random`'s weights, drawn in memory: `gpu_setup.py`):

1. decode: the engine's model forward (`ModelRunner.forward`) for a decode batch its scheduler made, every
   request's KV filled to `--context` tokens by the engine's own prefill, timed over a few steps with CUDA
   events, at batch 1 and batch 64 (CUDA graphs replayed; at batch 1 eager too: `batch_1_eager`). Its limit is
   the time to read what a decode step must read once: the weights (less the embedding table, of which a step
   reads a row per token; a tied head reads it whole) and every request's KV, at the bandwidth of a
   device-to-device `copy_` (2 * bytes / time). `decode_roofline_ratio` = limit time / measured time (target
   >= 0.7 at batch 1).
2. prefill: one `--prefill-tokens` request in one forward (chunk size = its length), flops = 2 * params *
   tokens (the head for its one logit row only) + causal attention 2 * T^2 * heads * head_dim per layer, against
   a bf16 [T, hidden] x [hidden, intermediate] matmul: `prefill_matmul_ratio` (target >= 0.5).
3. idle: the engine stepped by the serving loop's `Stepper` with overlap (as `disagg serve` steps it), batch 64,
   `--context`-token prompts, `--new-tokens` each. Each decode step's `ModelRunner.run` (forward + sampling) is
   bracketed by CUDA events; `idle_share` is the sum of the gaps between one step's end and the next one's start
   on the GPU's timeline over the span of the decode steps (target <= 0.05). GPU idle inside a step (its launch
   overhead) is not in it: compare decode_step_ms with the step's span (`step_span_ms`).
4. peer: transformers `generate` of the same workload as 3 on the same weights (the engine's tensors assigned to a
   `LlamaForCausalLM`), tokens/s, and ours (3's wall time, prefill included) over it.

Run on a GPU: `python bench/bench_gpu.py` (hack/gpu/run.sh runs it after the gpu tier; under 4 minutes on an
H100). Smoke test on a CPU: `--device cpu --shape llama-3.1-8b-mini --quick --out DIR`. Writes gpu.json (after
every section, so a timeout keeps what was done) and gpu.png where matplotlib is installed. A failing section
records its error and the others still run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.request import messages as msg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine_info  # noqa: E402
from gpu_setup import (  # noqa: E402
    Timer,
    copy_bandwidth,
    device_info,
    make_engine,
    matmul_tflops,
    model_dir,
    param_bytes,
    plot,
    random_model,
)


def add_requests(engine, n: int, prompt_len: int, new_tokens: int, vocab: int, seed: int = 0, tag: str = "") -> None:
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        ids = [rng.randrange(10, min(vocab, 2000)) for _ in range(prompt_len)]
        engine.handle(msg.GenerateReq(f"{tag}{i}", ids, params))


def until_decode(engine, n: int):
    """Step the engine synchronously (its prefill chunks, any early decode steps) until it schedules a decode
    batch of all `n` requests; returns that batch, not run."""
    while True:
        batch = engine.schedule()
        if batch is None:
            raise RuntimeError(f"the engine scheduled nothing before a decode batch of {n}: {engine.stats()}")
        if batch.forward.is_decode and batch.forward.num_requests == n:
            return batch
        engine.process(batch, engine.run(batch))
        engine.take_outputs()


def decode(ctx: dict, n: int, cuda_graph: bool = True) -> dict:
    """Section 1 at batch `n` (see the module's docstring); `cuda_graph` False: eager steps, for comparison."""
    a, timer, cfg = ctx["args"], ctx["timer"], ctx["cfg"]
    tokens = n * (a.context + 80) + 64
    engine = make_engine(ctx["model"], cfg, ctx["dir"], a.device, a.dtype, tokens, n, a.chunk, False, cuda_graph)
    try:
        add_requests(engine, n, a.context, 64, cfg.vocab_size, tag="d")
        batch = until_decode(engine, n)
        fwd = batch.forward
        times = timer.repeat(lambda: engine.runner.forward(fwd), warmup=3, reps=a.steps)
        step = statistics.median(times)
        kernels = top_kernels(lambda: engine.runner.forward(fwd), 3) if n == 1 and timer.cuda else None
        kv_per_token = engine.kv_pool.nbytes_per_page / engine.cfg.cache.page_size
    finally:
        engine.close()
    p = ctx["params"]
    weights = p["all_bytes"] - (0 if cfg.tie_word_embeddings else p["embed_bytes"])
    kv = kv_per_token * sum(fwd.seq_lens)
    limit_ms = (weights + kv) / (ctx["copy_gb_s"] * 1e6)
    return {
        "batch": n,
        "cuda_graph": engine.runner.graphs is not None,
        "context_mean": round(sum(fwd.seq_lens) / n, 1),
        "decode_step_ms": round(step, 3),
        "decode_step_ms_all": [round(t, 3) for t in times],
        "weight_bytes_read": weights,
        "kv_bytes_read": int(kv),
        "limit_ms": round(limit_ms, 3),
        "decode_roofline_ratio": round(limit_ms / step, 3),
        "tokens_s": round(n / step * 1000, 1),
        "kernels": kernels,
    }


def top_kernels(fn, reps: int, top: int = 25) -> dict:
    """Where a step's GPU time goes: the kernels of `reps` calls of `fn` under torch's profiler, the `top` by
    total time (name, calls per step, microseconds per step), and how many kernels a step launches."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return {
        "kernels_per_step": round(sum(e.count for e in rows) / reps, 1),
        "us_per_step": round(sum(e.device_time_total for e in rows) / reps, 1),
        "top": [(e.key[:90], round(e.count / reps, 1), round(e.device_time_total / reps, 1)) for e in rows[:top]],
    }


def prefill(ctx: dict) -> dict:
    """Section 2."""
    a, timer, cfg = ctx["args"], ctx["timer"], ctx["cfg"]
    t = a.prefill_tokens
    mm = matmul_tflops(a.device, ctx["dtype"], t, cfg.hidden_size, cfg.intermediate_size, timer, reps=5)
    engine = make_engine(ctx["model"], cfg, ctx["dir"], a.device, a.dtype, t + 256, 1, t, overlap=False)
    try:
        add_requests(engine, 1, t, 4, cfg.vocab_size, tag="p")
        batch = engine.schedule()
        fwd = batch.forward
        if fwd.num_tokens != t:
            raise RuntimeError(f"the engine scheduled {fwd.num_tokens} of the {t} prompt tokens in one forward")
        times = timer.repeat(lambda: engine.runner.forward(fwd), warmup=1, reps=a.prefill_reps)
    finally:
        engine.close()
    p = ctx["params"]
    body = p["all_params"] - p["embed_params"] - (0 if cfg.tie_word_embeddings else p["head_params"])
    dense = 2 * body * t + 2 * cfg.vocab_size * cfg.hidden_size  # the head for the last token's logits only
    attention = 2 * t * t * cfg.num_heads * cfg.head_dim * cfg.num_layers  # QK^T and PV, causal half
    best = min(times)
    tflops = (dense + attention) / best / 1e9
    return {
        "tokens": t,
        "forward_ms": round(best, 2),
        "forward_ms_all": [round(x, 2) for x in times],
        "flops_dense": dense,
        "flops_attention": attention,
        "tflop_s": round(tflops, 2),
        "matmul": mm,
        "prefill_matmul_ratio": round(tflops / mm["tflop_s"], 3),
        "tokens_s": round(t / best * 1000, 1),
    }


def stepper_for(engine):
    """The serving loop's Stepper (overlap on) when `instance.loop` imports (it needs pyzmq), else None."""
    try:
        from disagg_worker.instance.loop import Stepper
    except ImportError as e:
        return None, f"instance.loop does not import ({e}): stepped synchronously (schedule, run, process)"
    assert engine.cfg.overlap is True  # the executor's: launched steps overlap
    return Stepper(engine), "instance.loop.Stepper, overlap on"


def serve_run(ctx: dict) -> dict:
    """Section 3, and ours for section 4: the whole workload's wall time, and the decode steps' GPU gaps."""
    a, timer, cfg = ctx["args"], ctx["timer"], ctx["cfg"]
    n = a.batch
    engine = make_engine(
        ctx["model"], cfg, ctx["dir"], a.device, a.dtype, n * (a.context + a.new_tokens + 32), n, a.chunk
    )
    marks: list[tuple] = []
    run = engine.runner.run

    def bracketed(batch):
        decode = batch.forward.is_decode
        start = _mark(timer) if decode else None
        out = run(batch)
        if decode:
            marks.append((start, _mark(timer), batch.forward.num_requests))
        return out

    engine.runner.run = bracketed
    stepper, how = stepper_for(engine)
    try:
        add_requests(engine, min(n, 2), 16, 4, cfg.vocab_size, seed=1, tag="w")  # warm-up
        _drive(engine, stepper)
        marks.clear()
        timer.sync()
        add_requests(engine, n, a.context, a.new_tokens, cfg.vocab_size, seed=2, tag="s")
        t0 = time.perf_counter()
        produced = _drive(engine, stepper)
        timer.sync()
        wall = time.perf_counter() - t0
    finally:
        if stepper is not None:
            stepper.close()
        engine.close()
    full = [m for m in marks if m[2] == n]
    spans = [_elapsed(timer, s, e) for s, e, _ in full]
    gaps = [max(0.0, _elapsed(timer, full[i][1], full[i + 1][0])) for i in range(len(full) - 1)]
    total = _elapsed(timer, full[0][0], full[-1][1]) if full else 0.0
    return {
        "loop": how,
        "batch": n,
        "prompt_len": a.context,
        "new_tokens": a.new_tokens,
        "tokens": produced,
        "wall_s": round(wall, 3),
        "tokens_s": round(produced / wall, 1),
        "decode_steps_timed": len(full),
        "step_span_ms": round(statistics.median(spans), 3) if spans else None,
        "gap_ms_median": round(statistics.median(gaps), 4) if gaps else None,
        "idle_share": round(sum(gaps) / total, 4) if total > 0 and gaps else None,
    }


def _drive(engine, stepper) -> int:
    """Step until every request is done; the tokens produced."""
    produced = 0
    while (stepper.busy if stepper is not None else not engine.idle) or engine.has_batch_work:
        if stepper is not None:
            stepper.step()
        else:
            batch = engine.schedule()
            if batch is not None:
                engine.process(batch, engine.run(batch))
        for o in engine.take_outputs():
            if o.error:
                raise RuntimeError(f"request {o.rid} failed: {o.error}")
            produced += len(o.token_ids)
    return produced


def _mark(timer: Timer):
    if timer.cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


def _elapsed(timer: Timer, a, b) -> float:
    """ms from mark `a` to mark `b`."""
    if timer.cuda:
        b.synchronize()
        return a.elapsed_time(b)
    return (b - a) * 1000


def peer(ctx: dict, ours: dict) -> dict:
    """Section 4: transformers `generate` of section 3's workload on the same weights."""
    import transformers

    a, timer, cfg = ctx["args"], ctx["timer"], ctx["cfg"]
    conf = transformers.LlamaConfig(**{k: v for k, v in ctx["hf"].items() if k != "torch_dtype"})
    before = torch.get_default_dtype()
    torch.set_default_dtype(ctx["dtype"])
    try:
        with torch.device(a.device):
            hf = transformers.LlamaForCausalLM(conf)
    finally:
        torch.set_default_dtype(before)
    mine = ctx["model"].state_dict()
    theirs = hf.state_dict()
    same = {k: v for k, v in mine.items() if k in theirs and theirs[k].shape == v.shape}
    hf.load_state_dict(same, strict=False, assign=True)
    hf = hf.eval()
    del theirs
    gen = torch.Generator(device="cpu").manual_seed(3)
    ids = torch.randint(10, min(cfg.vocab_size, 2000), (a.batch, a.context), generator=gen).to(a.device)
    kw = {"do_sample": False, "pad_token_id": cfg.eos_token_ids[0]}
    with torch.inference_mode():
        hf.generate(ids[:2, :16], attention_mask=torch.ones_like(ids[:2, :16]), max_new_tokens=2, **kw)
        timer.sync()
        t0 = time.perf_counter()
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw
        )
        timer.sync()
        wall = time.perf_counter() - t0
    produced = (out.shape[1] - a.context) * a.batch
    del hf, out
    res = {
        "weights_shared": f"{len(same)} of {len(mine)} tensors",
        "attn_implementation": conf._attn_implementation if hasattr(conf, "_attn_implementation") else None,
        "tokens": produced,
        "wall_s": round(wall, 3),
        "tokens_s": round(produced / wall, 1),
    }
    if ours.get("tokens_s"):
        res["ours_tokens_s"] = ours["tokens_s"]
        res["ratio"] = round(ours["tokens_s"] / res["tokens_s"], 3)
    return res


def section(results: dict, out: Path, store: dict, name: str, fn, *args) -> dict:
    """Run one section into store[name], its error recorded instead where it fails; write all `results`."""
    t0 = time.perf_counter()
    try:
        res = fn(*args)
    except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    res["section_s"] = round(time.perf_counter() - t0, 2)
    store[name] = res
    (out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    shown = {k: v for k, v in res.items() if not isinstance(v, list | dict) and k != "traceback"}
    print(f"[bench_gpu] {name}: {shown}", flush=True)
    if a_cuda(results):
        torch.cuda.empty_cache()
    gc.collect()
    return res


def a_cuda(results: dict) -> bool:
    return str(results.get("device", {}).get("device", "")).startswith("cuda")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every section")
    p.add_argument("--plot-only", default=None, help="draw the PNG of an existing gpu.json and exit")
    a = p.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    big = not a.quick
    a.context = 1024 if big else 64
    a.batch = 64 if big else 4
    a.new_tokens = 32 if big else 4
    a.steps = 20 if big else 3
    a.chunk = 8192 if big else 256
    a.prefill_tokens = 8192 if big else 256
    a.prefill_reps = 3 if big else 1
    a.copy_bytes = 2**31 if big else 2**24
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.plot_only:
        print(plot(json.loads(Path(a.plot_only).read_text()), out / "gpu.png") or f"wrote {out / 'gpu.png'}")
        return 0
    started = time.perf_counter()
    results: dict = {"args": {k: v for k, v in vars(a).items() if k != "plot_only"}, "machine": machine_info()}
    results["device"] = device_info(a.device)
    timer = Timer(a.device)
    dtype = getattr(torch, a.dtype)
    bw = section(results, out, results, "copy_bandwidth", copy_bandwidth, a.device, dtype, a.copy_bytes, timer, 10)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        t0 = time.perf_counter()
        hf = model_dir(Path(tmp), a.shape, a.dtype)
        model, cfg = random_model(hf, dtype, a.device)
        timer.sync()
        results["model"] = {"shape": a.shape, "dtype": a.dtype, "build_s": round(time.perf_counter() - t0, 2)}
        params = param_bytes(model)
        results["model"] |= params
        ctx = {"args": a, "timer": timer, "cfg": cfg, "model": model, "dir": Path(tmp), "hf": hf}
        ctx |= {"dtype": dtype, "params": params, "copy_gb_s": bw.get("gb_s")}
        results["decode"] = {}
        for n in (1, a.batch):
            section(results, out, results["decode"], f"batch_{n}", decode, ctx, n)
        if a_cuda(results):  # what the graphs are worth where launches weigh most
            section(results, out, results["decode"], "batch_1_eager", decode, ctx, 1, False)
        section(results, out, results, "prefill", prefill, ctx)
        ours = section(results, out, results, "idle", serve_run, ctx)
        section(results, out, results, "peer", peer, ctx, ours)
    results["total_s"] = round(time.perf_counter() - started, 1)
    results["plot"] = plot(results, out / "gpu.png") or str(out / "gpu.png")
    (out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"[bench_gpu] done in {results['total_s']} s: {out / 'gpu.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
