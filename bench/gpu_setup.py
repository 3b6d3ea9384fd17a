"""What `bench_gpu.py` builds and times with: the random model of a named shape held in memory (no 16 GB written
and read back), engines around it, a timer that is CUDA events on a GPU and the wall clock on a CPU, the
device's description, the limits each figure is a ratio to (a device-to-device copy's bandwidth, a bf16 matmul's
TFLOP/s), and the optional plot.

The model is `random_model`'s (`disagg model make-random`): the same config and tokenizer files are written to a
temp dir (a few kB; the engine reads its tokenizer there), but the weights are drawn straight into the parameters
on the device, built the way `model.loader.load_model` builds a checkpoint's (meta, then assigned, tied, finished).
Writing Llama-3.1-8B's 16 GB as safetensors and loading it back would cost tens of seconds of a budget of minutes
for weights no figure depends on: decode and prefill time do not depend on the values.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from disagg_worker.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg_worker.engine.assemble import build_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.formats import weight_format
from disagg_worker.model.loader import fit_to_device
from disagg_worker.model.parallel import Shard
from disagg_worker.model.random_model import WEIGHT_STD, padded_tokenizer
from disagg_worker.model.registry import build_model
from disagg_worker.model.shapes import SHAPES
from disagg_worker.model.tiny import BOS_ID, EOS_ID, IM_END_ID, tokenizer_config, write_json


def model_dir(out: Path, shape: str, dtype: str) -> dict:
    """`make_random`'s files less the weights (config, generation config, tokenizer); returns the HF config."""
    hf = {**SHAPES[shape], "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "torch_dtype": dtype}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", hf)
    write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
    write_json(out / "tokenizer_config.json", tokenizer_config(hf))
    padded_tokenizer(hf["vocab_size"]).save(str(out / "tokenizer.json"))
    return hf


def random_model(hf: dict, dtype: torch.dtype, device: str, seed: int = 0) -> tuple[torch.nn.Module, ModelConfig]:
    """The engine's model of `hf`'s shape with weights normal(0, WEIGHT_STD) (norms near 1) drawn on `device`."""
    cfg = ModelConfig.from_hf_dict(hf)
    with torch.device("meta"):
        model = build_model(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=gen, device=device, dtype=dtype).mul_(WEIGHT_STD)
        state[name] = t.add_(1.0) if "norm" in name else t
    model.load_state_dict(state, strict=False, assign=True)
    del state
    model.tie_weights()
    model = model.to(device).eval().requires_grad_(False)
    model.finish_load()
    fit_to_device(model, torch.device(device), dtype, Shard(), weight_format(""))  # as `load_model` leaves one
    return model, cfg


def make_engine(
    model: torch.nn.Module,
    cfg: ModelConfig,
    path: Path,
    device: str,
    dtype: str,
    tokens: int,
    running: int,
    chunk: int,
    overlap: bool = True,
    cuda_graph: bool = True,
) -> Engine:
    """A monolithic engine around the in-memory `model`, its KV pool sized to `tokens` (page size 16, the model's
    dtype), as many tokens in a forward; on CUDA its decode steps replay CUDA graphs unless `cuda_graph` is False."""
    ecfg = EngineConfig(
        model_path=str(path),
        device=device,
        dtype=dtype,
        cache=CacheConfig(page_size=16, max_total_tokens=tokens, mem_fraction_static=0.0, kv_dtype=dtype),
        scheduler=SchedulerConfig(
            chunk_size=chunk,
            enable_overlap=overlap,
            max_running_requests=running,
            max_batch_tokens=tokens,  # every prompt's chunk in one forward: a decode batch then holds them all
            cuda_graph=cuda_graph,
        ),
    )
    return build_engine(ecfg, model, cfg)


def param_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes and counts of the parameters: all, the embedding table's, the output head's (tied: once)."""
    seen: set[int] = set()
    out = {"all_bytes": 0, "all_params": 0, "embed_bytes": 0, "embed_params": 0, "head_params": 0}
    for name, p in model.named_parameters(remove_duplicate=False):
        if "embed_tokens" in name:
            out["embed_bytes"] += p.numel() * p.element_size()
            out["embed_params"] += p.numel()
        if "lm_head" in name:
            out["head_params"] += p.numel()
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["all_bytes"] += p.numel() * p.element_size()
        out["all_params"] += p.numel()
    return out


class Timer:
    """Milliseconds of GPU work on the current stream between `start` and `stop` (CUDA events), or wall-clock
    milliseconds on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def measure(self, out: list[float]) -> Iterator[None]:
        """Append the time of the block's work to `out` (after a synchronize: the events have completed)."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            yield
            out.append((time.perf_counter() - t) * 1000)

    def repeat(self, fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
        """ms of each of `reps` calls of `fn` after `warmup` untimed ones."""
        for _ in range(warmup):
            fn()
        self.sync()
        times: list[float] = []
        for _ in range(reps):
            with self.measure(times):
                fn()
        return times


def copy_bandwidth(device: str, dtype: torch.dtype, nbytes: int, timer: Timer, reps: int) -> dict:
    """Device-to-device bandwidth of `dst.copy_(src)` over `nbytes`-byte buffers: 2 * bytes / time (read and
    write), the best of `reps` (the limit a decode step's weight and KV reads are held against)."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    src, dst = torch.empty(n, dtype=dtype, device=device).normal_(), torch.empty(n, dtype=dtype, device=device)
    times = timer.repeat(lambda: dst.copy_(src), warmup=2, reps=reps)
    best = min(times)
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return {"bytes": nbytes, "best_ms": round(best, 4), "gb_s": significant(2 * nbytes / best / 1e6)}


def matmul_tflops(device: str, dtype: torch.dtype, m: int, k: int, n: int, timer: Timer, reps: int) -> dict:
    """TFLOP/s of one [m, k] x [k, n] matmul in `dtype` (2*m*k*n flops), the best of `reps`: the limit for
    prefill, whose work is matmuls of these shapes."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    times = timer.repeat(lambda: a @ b, warmup=3, reps=reps)
    best = min(times)
    return {"shape": [m, k, n], "best_ms": round(best, 4), "tflop_s": significant(2 * m * k * n / best / 1e9)}


def significant(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits: a rate the other figures are divided by never rounds to 0 (a CPU copy
    or matmul slowed by a loaded machine read 0.0 GB/s at one decimal, and the ratios after it divided by it)."""
    return float(f"{x:.{digits}g}")


def device_info(device: str) -> dict:
    """The accelerator's name, memory, driver and the torch/triton/transformers versions."""
    info: dict = {"device": device, "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    for pkg in ("triton", "transformers"):
        try:
            info[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            info[pkg] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        info |= {"name": torch.cuda.get_device_name(device), "memory_gib": round(props.total_memory / 2**30, 1)}
        info["capability"] = f"{props.major}.{props.minor}"
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            info["driver"] = subprocess.run(smi, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["driver"] = f"unknown ({e})"
    return info


def plot(results: dict, path: Path) -> str | None:
    """A bar per ratio against its target line; None when drawn, else why not (no matplotlib on the device)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    bars = {
        "decode roofline b1": (results.get("decode", {}).get("batch_1", {}).get("decode_roofline_ratio"), 0.7),
        "decode roofline b64": (results.get("decode", {}).get("batch_64", {}).get("decode_roofline_ratio"), None),
        "prefill / matmul": (results.get("prefill", {}).get("prefill_matmul_ratio"), 0.5),
        "1 - idle share": (_busy(results.get("idle", {}).get("idle_share")), 0.95),
        "ours / transformers": (results.get("peer", {}).get("ratio"), 1.0),
    }
    names = [k for k, (v, _) in bars.items() if v is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [bars[k][0] for k in names], color="tab:blue")
    for i, k in enumerate(names):
        if bars[k][1] is not None:
            ax.hlines(bars[k][1], i - 0.4, i + 0.4, colors="tab:red", linestyles="dashed")
    ax.set_title(f"{results.get('device', {}).get('name', results.get('device', {}).get('device'))}: ratios to limits")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _busy(idle: float | None) -> float | None:
    return None if idle is None else 1 - idle
