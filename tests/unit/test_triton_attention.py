"""The Triton paged-attention kernels equal the torch path (`attention.paged_attention`), run on CPU tensors
under Triton's interpreter, and the CPU serving path never reaches them.

TRITON_INTERPRET=1 only takes effect if set before triton is first imported, so the kernel cases
(`triton_interpreted.py`) run in one subprocess with it set; each test here reads its case's result. All in
float32 (the interpreter's 16-bit `tl.dot` is not the GPU's): atol 1e-4, rtol 1e-4; the largest difference
seen is about 1e-6. tests/gpu/test_cuda_engine.py compares the compiled kernels on CUDA, bfloat16 included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from disagg_worker.model.attention import AttentionPlan, paged_attention
from tests.timing import scaled
from tests.unit.triton_interpreted import CASES, HEAD_DIM, KV_HEADS, batch_of, pool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    """Every case's result from one interpreted run: {"max_error": float} or {"error": traceback}."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run(
        [sys.executable, "-m", "tests.unit.triton_interpreted"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel_case(results, case):
    """One case of triton_interpreted.py: `interpreted` checks that the kernels ran as InterpretedFunctions."""
    result = results[case]
    assert "error" not in result, result["error"]
    assert result["max_error"] <= 1e-4


def test_the_cpu_serving_path_does_not_reach_triton(monkeypatch):
    """On the CPU the plan holds no page tables, even given a page size, and attention never imports the kernels."""

    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on the CPU")

    stub = types.SimpleNamespace(triton_paged_attention=refuse, page_tables=refuse)
    monkeypatch.setitem(sys.modules, "disagg_worker.model.triton_attention", stub)
    k_buf, v_buf = pool(16, seed=6)
    for plan in ([(40, 23), (0, 9)], [(33, 1), (70, 1)]):
        batch = batch_of(plan, 16, seed=6)
        built = AttentionPlan.build(batch, torch.device("cpu"), page_size=16)
        assert built.pages is None
        out = paged_attention(torch.randn(batch.num_tokens, KV_HEADS * 2, HEAD_DIM), built, k_buf, v_buf)
        assert out.shape == (batch.num_tokens, KV_HEADS * 2, HEAD_DIM)
