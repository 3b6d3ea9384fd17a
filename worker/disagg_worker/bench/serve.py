"""`disagg bench serve`: load-test an OpenAI-compatible server, in the manner of SGLang's bench_serving.

Prompts are random token-id lists (exact input lengths) sent to /v1/completions with streaming and
`ignore_eos`, so every request produces exactly its output length. Arrivals are Poisson at
`--request-rate` (inf: all at once), capped by `--max-concurrency`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestResult:
    ok: bool
    input_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="", help="model name (default: the server's first model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int, default=0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=1.0,
        help="lengths are uniform in [len*ratio, len]; 1.0 means fixed lengths",
    )
    p.add_argument("--vocab-low", type=int, default=10)
    p.add_argument("--vocab-high", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="", help="write the report as JSON here")


def make_workload(ns: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(ns.seed)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * ns.range_ratio), n))

    return [
        ([rng.randint(ns.vocab_low, ns.vocab_high - 1) for _ in range(length(ns.input_len))], length(ns.output_len))
        for _ in range(ns.num_prompts)
    ]


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], out_len: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    res = RequestResult(ok=False, input_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if res.output_len == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.output_len += 1
        res.e2e = time.perf_counter() - start
        res.ok = True
    except aiohttp.ClientError as e:
        res.error = repr(e)
    return res


async def run_load(ns: argparse.Namespace, model: str) -> tuple[list[RequestResult], float]:
    work = make_workload(ns)
    rng = random.Random(ns.seed + 1)
    sem = asyncio.Semaphore(ns.max_concurrency or len(work))
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def guarded(prompt, out_len):
            async with sem:
                return await one_request(session, ns.base_url, model, prompt, out_len)

        tasks = []
        start = time.perf_counter()
        for prompt, out_len in work:
            tasks.append(asyncio.create_task(guarded(prompt, out_len)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    report: dict[str, object] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.input_len for r in ok) / duration,
        "output_throughput": sum(r.output_len for r in ok) / duration,
        "mean_ttft_ms": statistics.fmean([r.ttft for r in ok]) * 1000 if ok else 0.0,
    }
    for name, vals in (("ttft", [r.ttft for r in ok]), ("itl", itls), ("e2e", [r.e2e for r in ok])):
        for q in (50, 90, 99):
            report[f"p{q}_{name}_ms"] = pct(vals, q) * 1000
    errors = [r.error for r in results if not r.ok][:5]
    if errors:
        report["errors"] = errors
    return report


async def first_model(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as resp:
            return (await resp.json())["data"][0]["id"]


async def bench(ns: argparse.Namespace) -> dict:
    model = ns.model or await first_model(ns.base_url)
    results, duration = await run_load(ns, model)
    report = summarize(results, duration)
    report["config"] = {k: v for k, v in vars(ns).items() if k not in ("func",)}
    return report


def main(ns: argparse.Namespace) -> int:
    report = asyncio.run(bench(ns))
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if ns.output:
        with open(ns.output, "w") as f:
            f.write(text)
    return 0 if report["failed"] == 0 else 1
