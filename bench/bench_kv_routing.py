"""KV-aware routing: a multi-turn chat on 2 prefill + 1 decode instances under round_robin, least_load,
cache_aware (`--policy`; the router's index of the prefills' caches from their KV events) and cache_aware+decode
(the same, with decode's prefix cache and conditional disaggregation: `--decode-prefix-cache --local-prefill` on
decode, `--decode-only-tokens 256` on the router, so that a turn whose history decode holds runs on decode alone).

Workload (the same requests under every policy; a fresh stack per policy and round, caches empty):
- `--conversations` chats (10) of `--turns` turns (6), all opening with one shared system prompt of about 600
  tokens (the start of `worker/disagg_worker/data/corpus.txt`); each user turn is a different ~70-token passage of
  the corpus with a question; the assistant's greedy answer (48 tokens) joins the history, so each turn's prompt is
  the last one plus ~120 tokens;
- conversations start at Poisson arrivals (mean gap 0.4 s, seeded); a conversation sends its next turn as soon as
  the last answer is complete;
- "skewed": the same, with conversation 0's system prompt 8x longer (its own text), to see whether one long
  stream pins a prefill instance.

Reported per policy and workload: TTFT p50 / p90 (streamed /v1/chat/completions, to the first content chunk),
prompt tokens computed by every instance (their /stats `prompt_tokens_computed`: what neither a cache nor a
transfer supplied; decode's own included), each prefill's share of the prefills' part, and whether every answer
equals round_robin's (routing must never change an answer).

"short": 30 one-at-a-time chat requests of a few words (distinct, ~20 tokens with the template, 8 answer tokens),
TTFT p50 through a monolithic server, the P/D stack (cache_aware) and cache_aware+decode: the handshake's fixed
cost, and what conditional disaggregation saves of it.

SmolLM2-135M-Instruct (`make demo-model`), float32, one torch thread per instance, page size 16.
Writes bench/results/kv_routing.json and kv_routing.png.  Usage: python bench/bench_kv_routing.py [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import DISAGG, RESULTS, free_port, get_json, machine_info  # noqa: E402

MODEL = ROOT / ".models" / "SmolLM2-135M-Instruct"
CORPUS = (ROOT / "worker" / "disagg_worker" / "data" / "corpus.txt").read_text().split()
POLICIES = ("round_robin", "least_load", "cache_aware", "cache_aware+decode")
DECODE_ONLY_TOKENS = 256
ANSWER = 48  # tokens per assistant turn
ENGINE = ("--page-size", "16", "--max-total-tokens", "16384", "--served-model-name", "m", "--log-level", "warning")


class Daemon:
    def __init__(self, args: list[str], port: int):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix="kvr-", suffix=".log")
        os.close(fd)
        env = {**os.environ, "MC_LOG_LEVEL": "WARNING"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [DISAGG, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(Path(self.log).read_text()[-3000:])
            try:
                if get_json(f"{self.url}/health").get("status") == "ok":
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def start_stack(config: str) -> tuple[Daemon, list[Daemon], list[Daemon]]:
    policy, decode_cache = config.removesuffix("+decode"), config.endswith("+decode")
    prefills = []
    for _ in range(2):
        port, bootstrap = free_port(), free_port()
        prefills.append(
            (
                Daemon(
                    [
                        "prefill",
                        "--model",
                        str(MODEL),
                        "--port",
                        str(port),
                        "--bootstrap-port",
                        str(bootstrap),
                        *ENGINE,
                    ],
                    port,
                ),
                bootstrap,
            )
        )
    dport = free_port()
    # A loaded 2-core machine can keep a prompt queued past the default 30 s the decode waits for its KV.
    own = ["--decode-prefix-cache", "--local-prefill"] if decode_cache else []
    decode = Daemon(
        ["decode", "--model", str(MODEL), "--port", str(dport), *ENGINE, "--waiting-timeout", "600", *own], dport
    )
    port = free_port()
    targets = [a for p, b in prefills for a in ("--prefill", p.url, str(b))]
    extra = ["--tokenizer", str(MODEL)] if policy == "cache_aware" else []
    extra += ["--decode-only-tokens", str(DECODE_ONLY_TOKENS)] if decode_cache else []
    args = ["router", "--port", str(port), "--served-model-name", "m", *targets, "--decode", decode.url]
    router = Daemon([*args, "--policy", policy, "--health-interval", "0.5", "--log-level", "warning", *extra], port)
    for d in [p for p, _ in prefills] + [decode, router]:
        d.wait()
    return router, [p for p, _ in prefills], [decode]


def words(start: int, n: int) -> str:
    return " ".join(CORPUS[start % len(CORPUS) : start % len(CORPUS) + n])


def conversations(n: int, turns: int, skewed: bool) -> list[dict]:
    """Each conversation: its system prompt and its user turns (the history grows with the answers)."""
    system = "You are a careful reader. The story:\n" + words(0, 420)
    out = []
    for c in range(n):
        own = "You are a careful reader. The story:\n" + words(3000, 8 * 420) if skewed and c == 0 else system
        user = [f"{words(500 + 97 * (c * turns + t), 50)}\nWhat happens next? Answer in detail." for t in range(turns)]
        out.append({"system": own, "user": user})
    return out


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict]) -> tuple[float, str]:
    body = {"model": "m", "messages": messages, "max_tokens": ANSWER, "temperature": 0, "stream": True}
    t0, ttft, text = time.perf_counter(), None, []
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(delta)
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(text)


async def run_load(url: str, convs: list[dict], seed: int) -> tuple[list[float], list[str]]:
    rng = random.Random(seed)
    starts = []
    t = 0.0
    for _ in convs:
        starts.append(t)
        t += rng.expovariate(1 / 0.4)
    ttfts: list[float] = []
    answers: dict[tuple[int, int], str] = {}

    async def one(i: int, conv: dict) -> None:
        await asyncio.sleep(starts[i])
        messages = [{"role": "system", "content": conv["system"]}]
        for turn, question in enumerate(conv["user"]):
            messages.append({"role": "user", "content": question})
            ttft, answer = await chat(session, url, messages)
            ttfts.append(ttft)
            answers[(i, turn)] = answer
            messages.append({"role": "assistant", "content": answer})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(i, c) for i, c in enumerate(convs)))
    return ttfts, [answers[k] for k in sorted(answers)]


def computed(url: str) -> int:
    return int(get_json(f"{url}/stats")["prompt_tokens_computed"])


def measure(policy: str, convs: list[dict], seed: int) -> dict:
    router, prefills, decodes = start_stack(policy)
    try:
        ttfts, answers = asyncio.run(run_load(router.url, convs, seed))
        time.sleep(1.0)  # the last reports
        per = [computed(p.url) for p in prefills]
        on_decode = sum(computed(d.url) for d in decodes)
        routing = get_json(f"{router.url}/health").get("routing", {})
    finally:
        for d in [router, *decodes, *prefills]:
            d.stop()
    q = statistics.quantiles(ttfts, n=10)
    return {
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_p90_ms": q[8] * 1e3,
        "prompt_tokens": sum(per) + on_decode,
        "max_share": max(per) / max(sum(per), 1),
        "per_prefill": per,
        "on_decode": on_decode,
        "routing": routing,
        "answers": answers,
    }


def start_mono() -> Daemon:
    port = free_port()
    mono = Daemon(["serve", "--model", str(MODEL), "--port", str(port), *ENGINE], port)
    mono.wait()
    return mono


def short_ttfts(url: str, n: int = 30) -> list[float]:
    """One at a time: short distinct questions, 8 answer tokens each; TTFT of each."""

    async def go() -> list[float]:
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            for i in range(n + 3):
                messages = [{"role": "user", "content": f"{words(7 * i, 3)}?"}]
                body = {"model": "m", "messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
                t0, ttft = time.perf_counter(), None
                async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if ttft is None and line.startswith(b"data: ") and b'"content"' in line:
                            ttft = time.perf_counter() - t0
                if i >= 3:  # the first few warm the path
                    out.append(ttft if ttft is not None else time.perf_counter() - t0)
        return out

    return asyncio.run(go())


def measure_short(rounds: int) -> dict:
    """TTFT p50 of short prompts: monolithic, P/D (cache_aware) and cache_aware+decode, interleaved per round."""
    runs: dict[str, list[float]] = {"monolithic": [], "cache_aware": [], "cache_aware+decode": []}
    for r in range(rounds):
        for name in runs if r % 2 == 0 else list(runs)[::-1]:
            if name == "monolithic":
                daemons = [start_mono()]
                url = daemons[0].url
            else:
                router, prefills, decodes = start_stack(name)
                daemons, url = [router, *decodes, *prefills], router.url
            try:
                runs[name].append(statistics.median(short_ttfts(url)) * 1e3)
            finally:
                for d in daemons:
                    d.stop()
            print(f"short round {r} {name}: TTFT p50 {runs[name][-1]:.1f} ms", flush=True)
    p50 = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "ttft_p50_ms": p50,
        "rounds_ms": runs,
        "vs_monolithic": {k: p50[k] / p50["monolithic"] for k in ("cache_aware", "cache_aware+decode")},
    }


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for w, workload in enumerate(("even", "skewed")):
        r = res["workloads"][workload]
        x = [i + 0.4 * w for i in range(len(POLICIES))]
        axes[0].bar(x, [r[p]["ttft_p50_ms"] for p in POLICIES], width=0.4, label=workload)
        axes[1].bar(x, [r[p]["prompt_tokens"] for p in POLICIES], width=0.4, label=workload)
        axes[2].bar(x, [100 * r[p]["max_share"] for p in POLICIES], width=0.4, label=workload)
    short = res["short"]["ttft_p50_ms"]
    axes[3].bar(list(short), list(short.values()), color="tab:green")
    axes[3].set_title("short prompts, one at a time: TTFT p50 (ms)", fontsize=9)
    axes[3].tick_params(axis="x", labelsize=8)
    titles = ("TTFT p50 (ms)", "prompt tokens computed (all instances)", "largest prefill share (%)")
    for ax, title in zip(axes[:3], titles, strict=True):
        ax.set_xticks([i + 0.2 for i in range(len(POLICIES))], POLICIES, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    m = res["machine"]
    fig.suptitle(f"multi-turn chat, 2 prefill + 1 decode, SmolLM2 float32; {m['cpu']}, {m['cores']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=6)
    a = p.parse_args()
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL} is missing: make demo-model")
    res: dict = {"machine": machine_info(), "config": vars(a), "workloads": {}}
    for workload in ("even", "skewed"):
        convs = conversations(a.conversations, a.turns, workload == "skewed")
        runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
        for r in range(a.rounds):
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                runs[policy].append(measure(policy, convs, seed=r))
                x = runs[policy][-1]
                print(
                    f"{workload} round {r} {policy}: TTFT p50 {x['ttft_p50_ms']:.0f} ms, prefill tokens "
                    f"{x['prompt_tokens']} {x['per_prefill']}, routing {x['routing']}",
                    flush=True,
                )
        base = runs["round_robin"][0]["answers"]
        res["workloads"][workload] = {
            p: {
                "ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in v),
                "ttft_p90_ms": statistics.median(x["ttft_p90_ms"] for x in v),
                "prompt_tokens": statistics.median(x["prompt_tokens"] for x in v),
                "max_share": statistics.median(x["max_share"] for x in v),
                "answers_equal_round_robin": all(x["answers"] == base for x in v),
                "rounds": [{k: x[k] for k in x if k != "answers"} for x in v],
            }
            for p, v in runs.items()
        }
        w = res["workloads"][workload]
        rr = w["round_robin"]
        for name in ("cache_aware", "cache_aware+decode"):
            ca = w[name]
            w[f"{name}_vs_round_robin"] = {
                "ttft_p50_speedup": rr["ttft_p50_ms"] / ca["ttft_p50_ms"],
                "prompt_tokens_ratio": ca["prompt_tokens"] / rr["prompt_tokens"],
            }
    res["short"] = measure_short(a.rounds)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_routing.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, RESULTS / "kv_routing.png")
    for workload, w in res["workloads"].items():
        for policy in POLICIES:
            x = w[policy]
            print(
                f"{workload:6s} {policy:18s} TTFT p50 {x['ttft_p50_ms']:7.0f} ms p90 {x['ttft_p90_ms']:7.0f} ms | "
                f"prompt tokens {x['prompt_tokens']:7.0f} | max share {100 * x['max_share']:4.0f}% | answers "
                f"equal: {x['answers_equal_round_robin']}"
            )
        print(workload, w["cache_aware_vs_round_robin"], w["cache_aware+decode_vs_round_robin"])
    print("short", res["short"]["ttft_p50_ms"], res["short"]["vs_monolithic"])


if __name__ == "__main__":
    main()
