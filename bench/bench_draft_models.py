"""Speculative decoding with a draft model (EAGLE, STANDALONE) against the same server without speculation, on
SmolLM2-135M-Instruct (float32), in one run on one machine: what a draft model costs when its drafts are wrong,
and what exact verification gives when they are right.

No trained draft can be downloaded here, so the drafts are of three kinds:
- `eagle_random`: a random-weight EAGLE head (`disagg model make-eagle-head`): its drafts are almost never kept,
  so this measures the cost of drafting in vain, which the pause rule bounds (`engine/speculative.py`);
- `standalone_random`: a random one-layer draft of SmolLM2's tokenizer and KV shape (`disagg model make-draft`):
  the same question for STANDALONE;
- `standalone_self`: SmolLM2 drafting for itself: every greedy draft is kept, but each draft token costs a
  forward of the model itself, so this bounds what the mechanism's bookkeeping costs per kept token (a real
  deployment pairs a target with a draft ten or more times smaller).

Workloads, rounds and measurements as `bench_speculative.py` (its prompts, greedy, streamed answers compared
with the plain server's), at `MAX_TOKENS` 96, `--speculative-num-steps` 3. Run:
`.venv/bin/python bench/bench_draft_models.py` (about 12 minutes on 2 cores). Writes
`bench/results/speculative_draft_models.json` and `.png`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_speculative as bs  # noqa: E402
from common import RESULTS, Serve, machine_info  # noqa: E402
from disagg_worker.model.eagle import make_eagle_head  # noqa: E402
from disagg_worker.model.tiny import make_draft  # noqa: E402

bs.MAX_TOKENS = 96
STEPS = ("--speculative-num-steps", "3")


def arms(tmp: Path) -> dict[str, tuple[str, ...]]:
    head = make_eagle_head(bs.MODEL, tmp / "eagle")
    small = make_draft(bs.MODEL, tmp / "small")
    return {
        "eagle_random": ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", str(head), *STEPS),
        "standalone_random": (
            "--speculative-algorithm",
            "STANDALONE",
            "--speculative-draft-model-path",
            str(small),
            *STEPS,
        ),
        "standalone_self": ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(bs.MODEL)),
    }


def measure(rounds: int, flags: dict[str, tuple[str, ...]]) -> dict:
    servers = {"plain": Serve(str(bs.MODEL), name="plain").start()}
    servers |= {name: Serve(str(bs.MODEL), *f, name=name).start() for name, f in flags.items()}
    runs: dict[str, dict[str, list[float]]] = {}
    drafting: dict[str, dict[str, float]] = {}
    try:
        for s in servers.values():
            s.wait_healthy()
            bs.load(s.url, bs.CHATS[:2], 2)  # warm-up: first requests pay for lazy initialisation
        for r in range(rounds):
            for workload, prompts in bs.WORKLOADS.items():
                for c in bs.CONCURRENCY:
                    key = f"{workload}_c{c}"
                    base = bs.load(servers["plain"].url, prompts, c)
                    row = runs.setdefault(key, {"plain": []})
                    row["plain"].append(base["output_tok_s"])
                    for name in flags:
                        url = servers[name].url
                        before = bs.settled_counters(url)
                        ours = bs.load(url, prompts, c)
                        after = bs.settled_counters(url)
                        same = sum(x == y for x, y in zip(base["answers"], ours["answers"], strict=True))
                        row.setdefault(name, []).append(ours["output_tok_s"])
                        row.setdefault(f"{name}_same", []).append(same / len(prompts))
                        if r == 0:
                            d = {k: after[k] - before[k] for k in after}
                            drafted = d["disagg_spec_draft_tokens_total"]
                            kept = d["disagg_spec_accepted_tokens_total"]
                            drafting[f"{key}/{name}"] = {
                                "accepted_share_of_drafted": round(kept / drafted, 3) if drafted else 0.0,
                                "drafted_tokens": drafted,
                            }
                        print(f"round {r} {key}: plain {base['output_tok_s']:.1f}, {name} {ours['output_tok_s']:.1f}")
    finally:
        for s in servers.values():
            s.stop()
    results: dict[str, dict] = {}
    for key, row in runs.items():
        plain = statistics.median(row["plain"])
        out: dict[str, object] = {"plain_tok_s": round(plain, 1), "plain_rounds": [round(v, 1) for v in row["plain"]]}
        for name in flags:
            tok_s = statistics.median(row[name])
            out[name] = {
                "tok_s": round(tok_s, 1),
                "ratio": round(tok_s / plain, 2),
                "rounds": [round(v, 1) for v in row[name]],
                "same_answers": min(row[f"{name}_same"]),
                **drafting[f"{key}/{name}"],
            }
        results[key] = out
    return results


def plot(res: dict, path: Path, names: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(res["results"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / (len(names) + 1)
    for j, name in enumerate(["plain", *names]):
        xs = [i + (j - len(names) / 2) * width for i in range(len(keys))]
        ys = [res["results"][k]["plain_tok_s"] if name == "plain" else res["results"][k][name]["tok_s"] for k in keys]
        ax.bar(xs, ys, width, label=name)
        if name != "plain":
            for x, k, y in zip(xs, keys, ys, strict=True):
                ax.annotate(f"{res['results'][k][name]['ratio']}x", (x, y), ha="center", fontsize=7)
    ax.set_xticks(range(len(keys)), [k.replace("_c", ", concurrency ") for k in keys], fontsize=8)
    ax.set_ylabel("output tok/s")
    m = res["machine"]
    ax.set_title(
        f"SmolLM2-135M-Instruct fp32, greedy, {bs.MAX_TOKENS} tokens, draft models; {m['cpu']}, {m['cores']} cores",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "speculative_draft_models"))
    a = p.parse_args()
    if not (bs.MODEL / "config.json").is_file():
        sys.exit(f"{bs.MODEL} is missing: run `make demo-model` first")
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        flags = arms(Path(tmp))
        results = measure(a.rounds, flags)
    machine["load_average_at_end"] = list(os.getloadavg())
    config = {
        "rounds": a.rounds,
        "max_tokens": bs.MAX_TOKENS,
        "num_steps": 3,
        "arms": {k: list(v) for k, v in flags.items()},
    }
    res = {"machine": machine, "config": config, "results": results}
    Path(f"{a.out}.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, Path(f"{a.out}.png"), list(flags))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
