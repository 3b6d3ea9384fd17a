"""KV tiers under the prefix cache: host memory (L2, `--enable-hierarchical-cache`) and Mooncake Store (L3,
`--hicache-storage-backend mooncake`), on a multi-turn chat whose live conversations need about 4x the KV pool.

Workload: `--conversations` chats of `--turns` turns, each with its own system prompt (~60 tokens: nothing is shared
between conversations), each user turn a different ~45-word passage of `worker/disagg_worker/data/corpus.txt` with a
question, each answer at most `--answer` greedy tokens; the history grows by ~90 tokens a turn. Conversations start
0.2 s apart and send each turn as soon as the last answer ends. The KV pool (`--max-total-tokens`) is a quarter of
what the conversations hold at their last turn (counted with the model's tokenizer and answers of full length), so
with the pool alone (L1) a conversation's history is evicted before its next turn comes.

1. One `disagg serve` per configuration, a fresh store for the store's: L1 only (no flags); L1+L2 (the host tier
   `--hicache-ratio` large enough for every conversation); L1+L2+L3 (host tier of `--l3-host-ratio`, half the
   working set with the pool, plus the store). Prompt tokens computed (`/stats`), TTFT p50/p90 (streamed chat, to
   the first content chunk), and whether every answer equals L1-only's.
2. Across instances: instance A serves the first half of every conversation's turns and is stopped; a newly
   started instance B serves the second half, with the store A wrote to, and without a store. B's prompt tokens
   computed against the turns' new tokens (each prompt's growth over the conversation's last prompt: the last
   answer, the template and the new user text).
3. Rolling restart: two instances (conversation c on instance c % 2), turns 0-2, instance 0 restarted, turn 3,
   instance 1 restarted, turn 4; with and without the store (both with the host tier, lost on restart). The hit
   rate (cached / prompt tokens, from each response's usage) of each instance's first turn after its restart,
   against the other instance's turns in the same phase.

Store runs use `--hicache-storage-prefetch-policy wait_complete`: a turn waits for its pages to come from the
store rather than racing them (best_effort admits a request at once on an idle instance).
SmolLM2-135M-Instruct (`make demo-model`), float32, one torch thread per instance, page size 16.
Writes bench/results/kv_tiers.json and kv_tiers.png.  Usage: python bench/bench_kv_tiers.py [--conversations N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import RESULTS, Serve, free_port, get_json, machine_info  # noqa: E402

MODEL = ROOT / ".models" / "SmolLM2-135M-Instruct"
CORPUS = (ROOT / "worker" / "disagg_worker" / "data" / "corpus.txt").read_text().split()
BIN = Path(sys.executable).parent
PAGE = 16
CONFIGS = ("L1", "L1+L2", "L1+L2+L3")


def words(start: int, n: int) -> str:
    return " ".join(CORPUS[start % len(CORPUS) : start % len(CORPUS) + n])


def conversations(n: int, turns: int) -> list[dict]:
    out = []
    for c in range(n):
        system = f"You are reader number {c}. Keep this passage in mind:\n{words(20000 + 53 * c, 40)}"
        user = [f"{words(500 + 61 * (c * turns + t), 45)}\nWhat happens next? Answer briefly." for t in range(turns)]
        out.append({"system": system, "user": user})
    return out


def working_set(convs: list[dict], model: Path, answer: int) -> int:
    """Tokens every conversation holds at its last turn, answers counted at full length."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    filler = " ".join(["word"] * answer)
    total = 0
    for conv in convs:
        messages = [{"role": "system", "content": conv["system"]}]
        for q in conv["user"]:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": filler}]
        text = tok.apply_chat_template(messages, tokenize=False)
        total += len(tok(text, add_special_tokens=False)["input_ids"])
    return total


class Store:
    """Mooncake Store on localhost: a master (with its HTTP metadata service) and one store server holding the
    memory. A fresh one per measurement, so that no run finds another's pages."""

    def __init__(self, segment: str = "1 GB"):
        self.rpc, self.meta, self.metrics, self.port = free_port(), free_port(), free_port(), free_port()
        self.master = f"127.0.0.1:{self.rpc}"
        self.metadata = f"http://127.0.0.1:{self.meta}/metadata"
        fd, self.log = tempfile.mkstemp(prefix="kvtiers-store-", suffix=".log")
        os.close(fd)
        self.procs: list[subprocess.Popen] = []
        self._spawn(
            [
                str(BIN / "mooncake_master"),
                f"-rpc_port={self.rpc}",
                "-enable_http_metadata_server=true",
                "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.meta}",
                f"-metrics_port={self.metrics}",
            ],
            {},
        )
        wait_port(self.rpc)
        wait_port(self.meta)
        rpc = free_port()
        env = {"MC_MIN_RPC_PORT": str(rpc), "MC_MAX_RPC_PORT": str(rpc + 7)}
        self._spawn(
            [
                str(BIN / "mooncake_client"),
                f"-global_segment_size={segment}",
                f"-master_server_address={self.master}",
                f"-metadata_server={self.metadata}",
                "-host=127.0.0.1",
                f"-port={self.port}",
                "-protocol=tcp",
            ],
            env,
        )
        wait_port(self.port)
        time.sleep(1.0)  # the server mounts its segment with the master after it listens

    def _spawn(self, argv: list[str], env: dict[str, str]) -> None:
        with open(self.log, "ab") as log:
            p = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
            )
        self.procs.append(p)

    def flags(self) -> list[str]:
        return [
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-store-master",
            self.master,
            "--hicache-store-metadata-server",
            self.metadata,
            "--hicache-storage-prefetch-policy",
            "wait_complete",
        ]

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
        Path(self.log).unlink(missing_ok=True)


def wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def serve(pool: int, *flags: str) -> Serve:
    engine = ["--served-model-name", "m", "--page-size", str(PAGE), "--max-total-tokens", str(pool)]
    return Serve(str(MODEL), *engine, *flags, env={"OMP_NUM_THREADS": "1"}, name="kvtiers")


def computed(s: Serve) -> int:
    return int(get_json(f"{s.url}/stats")["prompt_tokens_computed"])


async def chat(session: aiohttp.ClientSession, url: str, messages: list[dict], answer: int) -> dict:
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": answer,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, text, usage = time.perf_counter(), None, [], {}
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            delta = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(delta)
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "answer": "".join(text),
        "prompt_tokens": usage["prompt_tokens"],
        "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
    }


def run_turns(
    url_of: Callable[[int], str],
    convs: list[dict],
    hist: dict[int, list[dict]],
    turns: range,
    answer: int,
    gap: float = 0.2,
) -> list[dict]:
    """Turns `turns` of every conversation (each as soon as its last answer ends); `hist` (the messages so far per
    conversation) grows with them. One record per request: conversation, turn, TTFT, tokens, answer."""
    records: list[dict] = []

    async def one(c: int, session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(gap * c)
        messages = hist.setdefault(c, [{"role": "system", "content": convs[c]["system"]}])
        for t in turns:
            messages.append({"role": "user", "content": convs[c]["user"][t]})
            rec = await chat(session, url_of(c), messages, answer)
            records.append({"conv": c, "turn": t, **rec})
            messages.append({"role": "assistant", "content": rec["answer"]})

    async def go() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
            await asyncio.gather(*(one(c, session) for c in range(len(convs))))

    asyncio.run(go())
    return sorted(records, key=lambda r: (r["conv"], r["turn"]))


def p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e3 if len(values) > 1 else values[0] * 1e3


def part1(convs: list[dict], a: argparse.Namespace, pool: int) -> dict:
    out: dict = {}
    for config in CONFIGS:
        store = Store() if config == "L1+L2+L3" else None
        flags = {
            "L1": [],
            "L1+L2": ["--enable-hierarchical-cache", "--hicache-ratio", str(a.l2_host_ratio)],
            "L1+L2+L3": [
                "--enable-hierarchical-cache",
                "--hicache-ratio",
                str(a.l3_host_ratio),
                *(store.flags() if store else []),
            ],
        }[config]
        t0 = time.monotonic()
        try:
            with serve(pool, *flags) as s:
                recs = run_turns(lambda c, u=s.url: u, convs, {}, range(a.turns), a.answer)
                time.sleep(0.5)
                tokens = computed(s)
        finally:
            if store:
                store.stop()
        ttfts = [r["ttft"] for r in recs]
        out[config] = {
            "flags": flags[:3] if store else flags,
            "prompt_tokens_computed": tokens,
            "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
            "cached_tokens": sum(r["cached_tokens"] for r in recs),
            "ttft_p50_ms": p(ttfts, 50),
            "ttft_p90_ms": p(ttfts, 90),
            "seconds": time.monotonic() - t0,
            "answers": [r["answer"] for r in recs],
        }
        print(
            f"part 1 {config}: computed {tokens} of {out[config]['prompt_tokens']} prompt tokens, TTFT p50 "
            f"{out[config]['ttft_p50_ms']:.0f} ms, {out[config]['seconds']:.0f} s",
            flush=True,
        )
    base = out["L1"]
    for config in CONFIGS[1:]:
        x = out[config]
        x["answers_equal_l1"] = x["answers"] == base["answers"]
        x["vs_l1_token_ratio"] = x["prompt_tokens_computed"] / base["prompt_tokens_computed"]
        x["vs_l1_ttft_p50_speedup"] = base["ttft_p50_ms"] / x["ttft_p50_ms"]
    for x in out.values():
        del x["answers"]
    return out


def new_tokens(recs: list[dict], before: dict[int, int]) -> int:
    """Each prompt's growth over the same conversation's last prompt (`before`: the prompt before the first)."""
    last = dict(before)
    total = 0
    for r in recs:
        total += r["prompt_tokens"] - last[r["conv"]]
        last[r["conv"]] = r["prompt_tokens"]
    return total


def part2(convs: list[dict], a: argparse.Namespace, pool: int) -> dict:
    half = a.turns // 2
    host = ["--enable-hierarchical-cache", "--hicache-ratio", str(a.l3_host_ratio)]
    store = Store()
    out: dict = {}
    try:
        hist: dict[int, list[dict]] = {}
        with serve(pool, *host, *store.flags()) as s:
            first = run_turns(lambda c, u=s.url: u, convs, hist, range(half), a.answer)
            out["A_computed"] = computed(s)
        before = {r["conv"]: r["prompt_tokens"] for r in first if r["turn"] == half - 1}
        for name, flags in (("with_store", [*host, *store.flags()]), ("without_store", host)):
            h = {c: list(m) for c, m in hist.items()}
            with serve(pool, *flags) as s:
                recs = run_turns(lambda c, u=s.url: u, convs, h, range(half, a.turns), a.answer)
                time.sleep(0.5)
                tokens = computed(s)
            new = new_tokens(recs, before)
            out[name] = {
                "B_prompt_tokens_computed": tokens,
                "new_tokens": new,
                "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
                "computed_over_new_tokens": tokens / new,
                "ttft_p50_ms": p([r["ttft"] for r in recs], 50),
            }
            print(
                f"part 2 B {name}: computed {tokens}, new tokens {new}, prompt tokens {out[name]['prompt_tokens']}",
                flush=True,
            )
    finally:
        store.stop()
    out["turns_on_A"], out["turns_on_B"] = half, a.turns - half
    return out


def part3(convs: list[dict], a: argparse.Namespace, pool: int) -> dict:
    host = ["--enable-hierarchical-cache", "--hicache-ratio", str(a.l3_host_ratio)]
    out: dict = {}
    for name in ("with_store", "without_store"):
        store = Store() if name == "with_store" else None
        flags = [*host, *(store.flags() if store else [])]
        inst = [serve(pool, *flags).start() for _ in range(2)]
        try:
            for s in inst:
                s.wait_healthy()
            hist: dict[int, list[dict]] = {}
            run_turns(lambda c, u=[s.url for s in inst]: u[c % 2], convs, hist, range(3), a.answer)
            phases = []
            for i, turn in ((0, 3), (1, 4)):
                inst[i].stop()
                inst[i] = serve(pool, *flags).start()
                inst[i].wait_healthy()
                urls = [s.url for s in inst]
                recs = run_turns(lambda c, u=urls: u[c % 2], convs, hist, range(turn, turn + 1), a.answer)
                mine = [r for r in recs if r["conv"] % 2 == i]
                other = [r for r in recs if r["conv"] % 2 != i]
                phases.append(
                    {
                        "restarted": i,
                        "turn": turn,
                        "hit_rate_restarted": hit_rate(mine),
                        "hit_rate_other": hit_rate(other),
                        "restarted_prompt_tokens_computed": computed(inst[i]),
                        "restarted_prompt_tokens": sum(r["prompt_tokens"] for r in mine),
                    }
                )
                print(f"part 3 {name}: {phases[-1]}", flush=True)
        finally:
            for s in inst:
                s.stop()
            if store:
                store.stop()
        out[name] = {
            "phases": phases,
            "hit_rate_first_turn_after_restart": hit_rate_of(phases),
        }
    return out


def hit_rate(recs: list[dict]) -> float:
    return sum(r["cached_tokens"] for r in recs) / max(1, sum(r["prompt_tokens"] for r in recs))


def hit_rate_of(phases: list[dict]) -> float:
    tokens = sum(x["restarted_prompt_tokens"] for x in phases)
    return 1 - sum(x["restarted_prompt_tokens_computed"] for x in phases) / max(1, tokens)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    one = res["tiers"]
    axes[0].bar(CONFIGS, [one[c]["prompt_tokens_computed"] for c in CONFIGS], color="tab:blue")
    axes[0].set_title("1. prompt tokens computed", fontsize=9)
    axes[1].bar(CONFIGS, [one[c]["ttft_p50_ms"] for c in CONFIGS], color="tab:orange")
    axes[1].set_title("1. TTFT p50 (ms)", fontsize=9)
    two = res["across_instances"]
    names = ("with_store", "without_store")
    x = range(len(names))
    axes[2].bar([i - 0.2 for i in x], [two[n]["B_prompt_tokens_computed"] for n in names], 0.4, label="computed")
    axes[2].bar([i + 0.2 for i in x], [two[n]["new_tokens"] for n in names], 0.4, label="new tokens")
    axes[2].set_xticks(list(x), names)
    axes[2].set_title("2. instance B after A stopped: prompt tokens", fontsize=9)
    axes[2].legend(fontsize=7)
    three = res["rolling_restart"]
    axes[3].bar(names, [100 * three[n]["hit_rate_first_turn_after_restart"] for n in names], color="tab:green")
    axes[3].set_title("3. hit rate (%) of the first turn after a restart", fontsize=9)
    m, c = res["machine"], res["config"]
    fig.suptitle(
        f"KV tiers, {c['conversations']} conversations x {c['turns']} turns, pool {c['pool_tokens']} tokens "
        f"(working set {c['working_set_tokens']}), SmolLM2 float32; {m['cpu']}, {m['cores']} cores",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    global MODEL
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer at most")
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="the KV pool as a fraction of the working set")
    ap.add_argument("--l2-host-ratio", type=float, default=5.0, help="host tier (x pool) of L1+L2: the working set")
    ap.add_argument("--l3-host-ratio", type=float, default=2.0, help="host tier (x pool) under which the store sits")
    ap.add_argument("--parts", default="123", help="which parts to measure; the JSON keeps the others' last results")
    ap.add_argument("--plot-only", action="store_true")
    a = ap.parse_args()
    MODEL = a.model
    out = RESULTS / "kv_tiers.json"
    if a.plot_only:
        plot(json.loads(out.read_text()), RESULTS / "kv_tiers.png")
        return
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"{MODEL} is missing: make demo-model")
    convs = conversations(a.conversations, a.turns)
    ws = working_set(convs, MODEL, a.answer)
    pool = max(PAGE, round(ws * a.pool_fraction / PAGE) * PAGE)
    config = {k: v for k, v in vars(a).items() if k not in ("model", "plot_only")}
    res: dict = {"machine": machine_info(), "config": {**config, "working_set_tokens": ws, "pool_tokens": pool}}
    if a.parts != "123" and out.exists():  # re-measure some parts, keep the others' results (and their machine)
        kept = json.loads(out.read_text())
        res = {**kept, "rerun": {"parts": a.parts, "machine": res["machine"]}}
    print(f"working set {ws} tokens, pool {pool} tokens ({ws / pool:.2f}x)", flush=True)
    t0 = time.monotonic()
    if "1" in a.parts:
        res["tiers"] = part1(convs, a, pool)
        l3 = res["tiers"]["L1+L2+L3"]
        res["l1_l2_l3_vs_l1_token_ratio"] = l3["vs_l1_token_ratio"]
        res["l1_l2_l3_vs_l1_ttft_p50_speedup"] = l3["vs_l1_ttft_p50_speedup"]
        res["l1_l2_vs_l1_token_ratio"] = res["tiers"]["L1+L2"]["vs_l1_token_ratio"]
    if "2" in a.parts:
        res["across_instances"] = part2(convs, a, pool)
    if "3" in a.parts:
        res["rolling_restart"] = part3(convs, a, pool)
    where = res["rerun"] if "rerun" in res else res
    where["seconds"] = time.monotonic() - t0
    where["load_average_at_end"] = list(os.getloadavg())
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    if all(k in res for k in ("tiers", "across_instances", "rolling_restart")):
        plot(res, RESULTS / "kv_tiers.png")
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
