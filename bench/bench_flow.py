"""Two tenants on one P/D model: each tenant's TTFT over time, first come first served against flow control, same run.

One prefill and one decode of the tiny model (Mooncake TCP) and two `disagg router`s over that pair:
  fcfs: as the router runs by default, every request admitted at once (`--max-inflight` 1024): the workers
        queue what they hold in arrival order;
  flow: `--flow-control` with `--max-inflight` 4 (`--flow-max-inflight`): beyond that, requests wait in the
        router's queue, the highest priority first, the two tenants' flows round-robin within a priority.
Three streams of open-loop Poisson arrivals, from the same seed for both routers, streamed `/v1/completions` of
random token ids (so the prefix cache never helps):
  A, the batch tenant (`x-gateway-inference-fairness-id: tenant-a`): prompts of 2048 tokens at 10x B's rate
    (20/s), more than the pair can serve, so a queue builds up;
  B, the interactive tenant (`tenant-b`): prompts of 128 tokens, 2/s, a rate the pair serves easily alone;
  urgent: now and then a request of B's with `priority` 10.
Phases, each `--seconds` long: B and urgent alone through the fcfs router (the idle figure), then A, B and urgent
through fcfs, then through flow (A's queue at the flow router starts empty; its time to live, `--flow-queue-ttl`
20 s, answers what waits longer with 429). Requests of a phase still running when it ends are awaited before the
next one starts. Reports per phase and tenant: answered, refused (429), other failures with their messages, TTFT
p50/p90; the pair's output tokens/s over the phase; and the ratios the flow-control issue sets targets for: B's
TTFT p90 against B alone (<= 1.5x), urgent's against idle (<= 2x), output tokens/s flow / fcfs (>= 0.9: flow
control keeps the pair busy).
Writes bench/results/flow.json and flow.png.  Usage: python bench/bench_flow.py [--seconds S] [--seed N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))
from common import RESULTS, machine_info  # noqa: E402
from tests.integration.procs import Proc, free_port  # noqa: E402

FLAGS = ("--page-size", "16", "--chunk-size", "256", "--max-total-tokens", "65536", "--served-model-name", "tiny")
VOCAB_HIGH = 2000  # prompt token ids below the tiny model's vocabulary
FAIRNESS = "x-gateway-inference-fairness-id"


@dataclass(frozen=True)
class Tenant:
    name: str
    flow: str
    rate: float  # requests per second
    input_len: int
    output_len: int
    priority: int = 0


@dataclass
class Result:
    tenant: str
    sent: float  # seconds since the phase began
    status: int
    ttft_s: float  # 0 when no token came
    tokens: int
    error: str = ""  # the error body's message, for a status other than 200


def tenants(a: argparse.Namespace) -> list[Tenant]:
    return [
        Tenant("A", "tenant-a", 10 * a.b_rate, a.a_input, a.output_len),
        Tenant("B", "tenant-b", a.b_rate, a.b_input, a.output_len),
        Tenant("urgent", "tenant-b", a.urgent_rate, a.b_input, a.output_len, priority=10),
    ]


def arrivals(ts: list[Tenant], seconds: float, seed: int) -> list[tuple[float, Tenant, list[int]]]:
    """(when, tenant, prompt) of every request of a phase, Poisson per tenant, in time order."""
    rng = random.Random(seed)
    out = []
    for t in ts:
        at = rng.expovariate(t.rate)
        while at < seconds:
            out.append((at, t, [rng.randrange(1, VOCAB_HIGH) for _ in range(t.input_len)]))
            at += rng.expovariate(t.rate)
    return sorted(out, key=lambda x: x[0])


async def one(session: aiohttp.ClientSession, url: str, t: Tenant, prompt: list[int], start: float) -> Result:
    sent = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": t.output_len, "ignore_eos": True, "temperature": 0, "stream": True}
    if t.priority:
        body["priority"] = t.priority
    first, tokens = 0.0, 0
    async with session.post(f"{url}/v1/completions", json=body, headers={FAIRNESS: t.flow}) as r:
        if r.status != 200:
            text = (await r.read()).decode(errors="replace")
            return Result(t.name, sent - start, r.status, 0.0, 0, _message(text))
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") is not None:
                tokens += 1
                first = first or time.perf_counter()
    return Result(t.name, sent - start, 200, (first - sent) if first else 0.0, tokens)


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def phase(url: str, plan: list[tuple[float, Tenant, list[int]]]) -> tuple[list[Result], float]:
    """Send `plan` to `url` on time; (every result, the phase's wall seconds until its last answer)."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        tasks = []
        for at, t, prompt in plan:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session, url, t, prompt, start)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summary(results: list[Result], wall_s: float) -> dict:
    out: dict = {"output_tok_s": round(sum(r.tokens for r in results) / wall_s, 1), "wall_s": round(wall_s, 1)}
    for name in sorted({r.tenant for r in results}):
        mine = [r for r in results if r.tenant == name]
        ttft = sorted(r.ttft_s * 1000 for r in mine if r.status == 200)
        out[name] = {
            "sent": len(mine),
            "answered": len(ttft),
            "refused_429": sum(r.status == 429 for r in mine),
            "other_status": sorted({r.status for r in mine} - {200, 429}),
            "errors": sorted({f"{r.status}: {r.error}" for r in mine if r.status not in (200, 429)})[:5],
            "p50_ttft_ms": round(statistics.median(ttft), 1) if ttft else None,
            "p90_ttft_ms": round(statistics.quantiles(ttft, n=10)[-1], 1) if len(ttft) >= 2 else None,
        }
    return out


def start(model: str, ttl: float, flow_inflight: int) -> tuple[list[Proc], dict[str, str]]:
    bootstrap, pport, dport = free_port(), free_port(), free_port()
    prefill = Proc(
        ["prefill", "--model", model, "--port", str(pport), "--bootstrap-port", str(bootstrap), *FLAGS], pport
    )
    decode = Proc(["decode", "--model", model, "--port", str(dport), "--bootstrap-port", str(bootstrap), *FLAGS], dport)
    for p in (prefill, decode):
        p.wait_healthy(300)
    pair = ["--served-model-name", "tiny", "--prefill", prefill.url, str(bootstrap), "--decode", decode.url]
    routers = {}
    for name, extra in {
        "fcfs": [],
        "flow": ["--flow-control", "--max-inflight", str(flow_inflight), "--flow-queue-ttl", f"{ttl:g}"],
    }.items():
        port = free_port()
        routers[name] = Proc(["router", "--port", str(port), *pair, *extra], port)
    for r in routers.values():
        r.wait_healthy()
    return [prefill, decode, *routers.values()], {name: r.url for name, r in routers.items()}


def plot(res: dict, raw: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"A": "tab:orange", "B": "tab:blue", "urgent": "tab:red"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, name in zip(axes, ("fcfs", "flow"), strict=True):
        for tenant, color in colors.items():
            pts = [(r["sent"], r["ttft_s"] * 1000) for r in raw[name] if r["tenant"] == tenant and r["status"] == 200]
            if pts:
                ax.scatter(*zip(*pts, strict=True), s=6, color=color, label=tenant)
        ax.set_title(f"{name}: {res['phases'][name]['output_tok_s']:.0f} output tok/s", fontsize=10)
        ax.set_xlabel("request sent at (s)")
        ax.set_yscale("log")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend()
    m = res["machine"]
    fig.suptitle(
        f"Tenant A at 10x B's rate, tiny model P/D: B p90 {res['ratios']['b_p90_flow_over_alone']}x alone with flow "
        f"control, {res['ratios']['b_p90_fcfs_over_alone']}x without ({m['cpu']} x{m['cores']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def measure(a: argparse.Namespace, ts: list[Tenant], model: str, res: dict, raw: dict[str, list[dict]]) -> None:
    """The three phases on one pair, into `res["phases"]` (summaries) and `raw` (every request)."""
    procs, urls = start(model, a.flow_queue_ttl, a.flow_max_inflight)
    try:
        plans = {
            "alone": (urls["fcfs"], arrivals([ts[1], ts[2]], a.seconds, a.seed)),
            "fcfs": (urls["fcfs"], arrivals(ts, a.seconds, a.seed)),
            "flow": (urls["flow"], arrivals(ts, a.seconds, a.seed)),
        }
        for name, (url, plan) in plans.items():
            results, wall = asyncio.run(phase(url, plan))
            res["phases"][name] = summary(results, wall)
            raw[name] = [asdict(r) for r in results]
            print(name, json.dumps(res["phases"][name]), flush=True)
    finally:
        for proc in procs:
            proc.stop()


def ratio(x: float | None, y: float | None) -> float | None:
    return round(x / y, 2) if x and y else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="each phase's arrivals")
    p.add_argument("--b-rate", type=float, default=2.0, help="B's requests per second (A sends 10x)")
    p.add_argument("--urgent-rate", type=float, default=0.25)
    p.add_argument("--a-input", type=int, default=2048)
    p.add_argument("--b-input", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--flow-max-inflight", type=int, default=4)
    p.add_argument("--flow-queue-ttl", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from disagg_worker.model.tiny import make_tiny

    t0 = time.perf_counter()
    res: dict = {"machine": machine_info(), "config": vars(a), "phases": {}}
    raw: dict[str, list[dict]] = {}
    ts = tenants(a)
    with tempfile.TemporaryDirectory(prefix="bench-flow-") as model:
        make_tiny(Path(model))
        measure(a, ts, model, res, raw)
    ph = res["phases"]
    res["ratios"] = {
        "b_p90_flow_over_alone": ratio(ph["flow"]["B"]["p90_ttft_ms"], ph["alone"]["B"]["p90_ttft_ms"]),
        "b_p90_fcfs_over_alone": ratio(ph["fcfs"]["B"]["p90_ttft_ms"], ph["alone"]["B"]["p90_ttft_ms"]),
        "urgent_p90_flow_over_idle": ratio(ph["flow"]["urgent"]["p90_ttft_ms"], ph["alone"]["urgent"]["p90_ttft_ms"]),
        "urgent_p90_fcfs_over_idle": ratio(ph["fcfs"]["urgent"]["p90_ttft_ms"], ph["alone"]["urgent"]["p90_ttft_ms"]),
        "output_tok_s_flow_over_fcfs": ratio(ph["flow"]["output_tok_s"], ph["fcfs"]["output_tok_s"]),
    }
    r = res["ratios"]
    res["targets"] = {
        "b_p90_within_1.5x_alone": bool(r["b_p90_flow_over_alone"] and r["b_p90_flow_over_alone"] <= 1.5),
        "urgent_p90_within_2x_idle": bool(r["urgent_p90_flow_over_idle"] and r["urgent_p90_flow_over_idle"] <= 2),
        "throughput_within_10pct_of_fcfs": bool(
            r["output_tok_s_flow_over_fcfs"] and r["output_tok_s_flow_over_fcfs"] >= 0.9
        ),
    }
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    (RESULTS / "flow.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, raw, RESULTS / "flow.png")
    print(json.dumps({k: res[k] for k in ("ratios", "targets")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
