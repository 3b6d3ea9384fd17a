"""bench/bench_gpu.py runs end to end on a CPU at its smoke-test size (mini shape, --quick): every section gives
its figures, none an error. The GPU figures themselves come from hack/gpu/run.sh on a GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_gpu_quick_on_cpu_writes_every_section(tmp_path):
    paths = [str(ROOT / d) for d in ("worker", "operator", "api")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--device", "cpu", "--shape", "llama-3.1-8b-mini"]
    out = subprocess.run(
        [*cmd, "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "gpu.json").read_text())
    assert {"machine", "device", "copy_bandwidth", "model", "decode", "prefill", "idle", "peer"} <= res.keys()
    sections = [res["copy_bandwidth"], *res["decode"].values(), res["prefill"], res["idle"], res["peer"]]
    assert not [s["error"] for s in sections if "error" in s]
    assert set(res["decode"]) == {"batch_1", "batch_4"}
    for d in res["decode"].values():
        assert d["decode_step_ms"] > 0 and d["decode_roofline_ratio"] > 0
    assert res["prefill"]["prefill_matmul_ratio"] > 0
    assert res["idle"]["tokens"] == 4 * 4 and 0 <= res["idle"]["idle_share"] <= 1
    assert res["peer"]["ratio"] > 0


def test_a_rate_the_ratios_divide_by_never_rounds_to_zero():
    """A loaded machine slowed the CPU matmul to 0.004 TFLOP/s, which two decimals made 0.0 and the prefill
    section's ratio divided by."""
    spec = importlib.util.spec_from_file_location("gpu_setup", ROOT / "bench" / "gpu_setup.py")
    assert spec is not None and spec.loader is not None
    gpu_setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_setup)
    significant = gpu_setup.significant
    assert significant(0.004321) == 0.004321 and significant(123456.7) == 123500.0 and significant(5e-9) > 0
