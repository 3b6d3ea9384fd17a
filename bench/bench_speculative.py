"""Speculative decoding with n-gram drafts (`--speculative-algorithm NGRAM`) against the same server without it,
on SmolLM2-135M-Instruct (the demo model, float32, `make serve`'s conversion), in one run on one machine.

Two workloads of chat requests, greedy, `max_tokens` 160, streamed through the OpenAI API:
- repetition-heavy (`EDITS`): edit a given paragraph or code block and show it again, or quote a passage back:
  what n-gram drafts are for;
- plain chat (`CHATS`): questions whose answers repeat nothing of the prompt: speculation should cost nothing.

Each workload runs at concurrency 1 (each request alone, one after another) and at concurrency 8 (all at
once). Rounds alternate the two servers (`--rounds`, default 3; medians). Reported: output tokens/s of each,
the ratio, and for the speculating server the mean tokens a decode step added per request (accepted drafts + 1,
from `disagg_spec_accept_length`) and the share of drafted tokens kept. The answers of both servers are
compared: they must be the same text. Run: `.venv/bin/python bench/bench_speculative.py` (about 6 minutes on 2
cores). Writes `bench/results/speculative.json` and `bench/results/speculative.png`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, Serve, machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".models" / "SmolLM2-135M-Instruct"
NGRAM = ("--speculative-algorithm", "NGRAM")
PARAGRAPH = (
    "The harbour was quiet in the early morning. Fishing boats rocked gently against the pier, their ropes "
    "creaking, while gulls circled above the market stalls that were only beginning to open."
)
CODE = (
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item.price * "
    "item.quantity\n    return subtotal * (1 + tax_rate)\n"
)
EDITS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rewrite this paragraph replacing 'harbour' with 'port', and change nothing else:\n\n{PARAGRAPH}",
    f"Rename the function total_price to order_total in this code and show the whole code again:\n\n{CODE}",
    f"Add a docstring to this function and show the whole code:\n\n{CODE}",
    f"Quote the second sentence of this text back to me:\n\n{PARAGRAPH}",
    f"Copy this code exactly, then explain it in one sentence:\n\n{CODE}",
    f"Translate this paragraph into plain English, keeping every sentence:\n\n{PARAGRAPH}",
    f"Change tax_rate to vat in this code, show it all:\n\n{CODE}",
]
CHATS = [
    "What is the capital of France?",
    "Write a short poem about autumn leaves.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Explain what a database index is.",
    "Suggest a name for a black cat.",
    "What are the benefits of walking every day?",
    "Describe a sunrise over the mountains.",
]
WORKLOADS = {"repetition_heavy": EDITS, "plain_chat": CHATS}
CONCURRENCY = (1, 8)
MAX_TOKENS = 160


def chat(url: str, content: str) -> tuple[str, int]:
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        out = json.loads(resp.read())
    return out["choices"][0]["message"]["content"], out["usage"]["completion_tokens"]


def load(url: str, prompts: list[str], concurrency: int) -> dict:
    """Every prompt at `concurrency` in flight: output tokens/s over the whole load, and the answers."""
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: chat(url, p), prompts))
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {"output_tok_s": tokens / elapsed, "tokens": tokens, "answers": [t for t, _ in results]}


def spec_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = (
        "disagg_spec_draft_tokens_total",
        "disagg_spec_accepted_tokens_total",
        "disagg_spec_accept_length_sum",
        "disagg_spec_accept_length_count",
    )
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in out:
            out[name] = float(value)
    return out


def settled_counters(url: str) -> dict[str, float]:
    """The counters once the engine's next report has carried them to the HTTP process (every 0.5 s)."""
    time.sleep(1.2)
    return spec_counters(url)


def measure(a: argparse.Namespace) -> dict:
    plain, spec = Serve(str(MODEL), name="plain").start(), Serve(str(MODEL), *NGRAM, name="ngram").start()
    try:
        plain.wait_healthy(), spec.wait_healthy()
        for s in (plain, spec):  # warm-up: first requests pay for lazy initialisation
            load(s.url, CHATS[:2], 2)
        runs: dict[str, dict[str, list[float]]] = {}
        drafting: dict[str, dict[str, float]] = {}
        for r in range(a.rounds):
            for name, prompts in WORKLOADS.items():
                for c in CONCURRENCY:
                    key = f"{name}_c{c}"
                    base = load(plain.url, prompts, c)
                    before = settled_counters(spec.url)
                    ours = load(spec.url, prompts, c)
                    after = settled_counters(spec.url)
                    same = sum(x == y for x, y in zip(base["answers"], ours["answers"], strict=True))
                    row = runs.setdefault(key, {"plain": [], "ngram": [], "same_answers": []})
                    row["plain"].append(base["output_tok_s"])
                    row["ngram"].append(ours["output_tok_s"])
                    row["same_answers"].append(same / len(prompts))
                    if r == 0:
                        d = {k: after[k] - before[k] for k in after}
                        steps = d["disagg_spec_accept_length_count"]
                        drafted = d["disagg_spec_draft_tokens_total"]
                        drafting[key] = {
                            "tokens_per_verified_step": d["disagg_spec_accept_length_sum"] / steps if steps else 0,
                            "accepted_share_of_drafted": d["disagg_spec_accepted_tokens_total"] / drafted
                            if drafted
                            else 0,
                            "verified_steps": steps,
                        }
                    print(f"round {r} {key}: plain {base['output_tok_s']:.1f} ngram {ours['output_tok_s']:.1f} tok/s")
    finally:
        plain.stop()
        spec.stop()
    results = {}
    for key, row in runs.items():
        p, n = statistics.median(row["plain"]), statistics.median(row["ngram"])
        results[key] = {
            "plain_tok_s": round(p, 1),
            "ngram_tok_s": round(n, 1),
            "ratio": round(n / p, 2),
            "plain_rounds": [round(v, 1) for v in row["plain"]],
            "ngram_rounds": [round(v, 1) for v in row["ngram"]],
            "same_answers": min(row["same_answers"]),
            **{k: round(v, 3) for k, v in drafting[key].items()},
        }
    return results


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(res["results"])
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [res["results"][k]["plain_tok_s"] for k in keys], 0.4, label="no speculation")
    ax.bar([x + 0.2 for x in xs], [res["results"][k]["ngram_tok_s"] for k in keys], 0.4, label="NGRAM")
    for x, k in zip(xs, keys, strict=True):
        ax.annotate(f"{res['results'][k]['ratio']}x", (x + 0.2, res["results"][k]["ngram_tok_s"]), ha="center")
    ax.set_xticks(list(xs), [k.replace("_c", ", concurrency ") for k in keys], fontsize=8)
    ax.set_ylabel("output tok/s")
    m = res["machine"]
    ax.set_title(f"SmolLM2-135M-Instruct fp32, greedy, {MAX_TOKENS} tokens; {m['cpu']}, {m['cores']} cores", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "speculative"))
    a = p.parse_args()
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: run `make demo-model` first")
    machine = machine_info()
    results = measure(a)
    import os

    machine["load_average_at_end"] = list(os.getloadavg())
    res = {"machine": machine, "config": {"rounds": a.rounds, "max_tokens": MAX_TOKENS}, "results": results}
    Path(f"{a.out}.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, Path(f"{a.out}.png"))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
