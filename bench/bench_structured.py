"""Structured output overhead: SmolLM2-135M-Instruct served by `disagg serve`, the same chat prompts with
and without `response_format` (a JSON schema), in one run.

32 chat requests at once (default), each asking for a list, `max_tokens` 64, greedy: once as free
text, once with a `json_schema` response format (an object holding a list of strings). Rounds alternate
between the two (`--rounds`, default 2; medians). The figure is output tokens per second over the
whole load (completion tokens / wall time, prefill included) and the ratio constrained / free; also the
mean completion length of each (a JSON answer may end before `max_tokens`) and how many constrained
answers parse as JSON and follow the schema (all must, or the run fails). Run:
`.venv/bin/python bench/bench_structured.py` (about 70 s on 2 cores). Writes
`bench/results/structured.json` and `bench/results/structured.png`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DISAGG, RESULTS, Serve, machine_info  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    "required": ["items"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "list", "schema": SCHEMA}}
TOPICS = ["animals", "fruits", "cities", "colours", "rivers", "composers", "trees", "birds"]


def prompts(n: int) -> list[str]:
    return [f"List {10 + i % 7} {TOPICS[i % len(TOPICS)]}, as JSON with a key items." for i in range(n)]


def one(url: str, prompt: str, max_tokens: int, constrained: bool) -> tuple[int, tuple[str, str]]:
    body: dict = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if constrained:
        body["response_format"] = FORMAT
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    return out["usage"]["completion_tokens"], (choice["message"]["content"], choice["finish_reason"])


def load(url: str, texts: list[str], max_tokens: int, constrained: bool) -> dict:
    start = time.perf_counter()
    with cf.ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(lambda p: one(url, p, max_tokens, constrained), texts))
    wall = time.perf_counter() - start
    tokens = sum(n for n, _ in answers)
    return {"tok_s": tokens / wall, "mean_tokens": tokens / len(answers), "answers": [a for _, a in answers]}


def follows_schema(text: str, finished: bool) -> bool:
    """A complete answer parses and follows SCHEMA; one cut at max_tokens only has to start as it."""
    if not finished:
        return text.startswith('{"items": [')
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return set(value) == {"items"} and all(isinstance(x, str) for x in value["items"])


def measure(model: str, a: argparse.Namespace) -> dict:
    texts = prompts(a.num_prompts)
    env = {"OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    runs: dict[str, list[dict]] = {"free": [], "json_schema": []}
    with Serve(model, "--torch-threads", str(a.threads), env=env, name="bench-structured") as srv:
        load(srv.url, texts[:4], 8, True)  # warm-up, and the first compile of the schema
        load(srv.url, texts[:4], 8, False)
        for _ in range(a.rounds):
            runs["free"].append(load(srv.url, texts, a.max_tokens, False))
            runs["json_schema"].append(load(srv.url, texts, a.max_tokens, True))
    answers = [answer for r in runs["json_schema"] for answer in r["answers"]]
    valid = [follows_schema(text, reason == "stop") for text, reason in answers]
    if not all(valid):
        bad = [a for a, ok in zip(answers, valid, strict=True) if not ok]
        raise SystemExit(f"{len(bad)} constrained answers do not follow the schema, such as {bad[:3]}")
    out = {
        k: {
            "output_tok_s": round(statistics.median(r["tok_s"] for r in v), 1),
            "output_tok_s_rounds": [round(r["tok_s"], 1) for r in v],
            "mean_completion_tokens": round(statistics.mean(r["mean_tokens"] for r in v), 1),
        }
        for k, v in runs.items()
    }
    out["json_schema"]["answers_following_the_schema"] = f"{sum(valid)}/{len(valid)}"
    out["json_schema"]["example"] = runs["json_schema"][0]["answers"][0][0]
    out["json_schema"]["finished_before_max_tokens"] = sum(reason == "stop" for _, reason in answers)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, m = res["config"], res["machine"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = [res["free"]["output_tok_s"], res["json_schema"]["output_tok_s"]]
    ax.bar(["free text", "response_format\njson_schema"], bars, color=["tab:gray", "tab:blue"])
    for x, y in enumerate(bars):
        ax.text(x, y, f"{y:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tok/s")
    ax.set_title(
        f"SmolLM2-135M-Instruct, {c['num_prompts']} chats at once, <= {c['max_tokens']} tokens: {res['ratio']:.2f}x",
        fontsize=10,
    )
    fig.suptitle(f"{m['cpu']} x{m['cores']}, load {m['load_average_at_start'][0]:.1f} at start", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help="a converted SmolLM2 directory (default: convert the demo GGUF)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    from importlib.metadata import version

    res: dict = {"machine": machine_info(xgrammar=version("xgrammar")), "config": vars(a)}
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as tmp:
        model = a.model or str(Path(tmp) / "SmolLM2-135M-Instruct")
        if not a.model:
            subprocess.run([DISAGG, "model", "convert-gguf", "--out", model], check=True, stdout=subprocess.DEVNULL)
        res.update(measure(model, a))
    res["ratio"] = round(res["json_schema"]["output_tok_s"] / res["free"]["output_tok_s"], 3)
    res["targets"] = {"structured_over_free_ge_0.8": res["ratio"] >= 0.8}
    res["machine"]["load_average_at_end"] = list(os.getloadavg())
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    out = RESULTS / "structured.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out.with_suffix(".png"))
    print(json.dumps({k: res[k] for k in ("free", "json_schema", "ratio", "targets", "wall_s")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
