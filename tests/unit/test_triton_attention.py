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


def interpreted_results(module: str) -> dict[str, dict]:
    """Every case's result from one run of `module` in a process of its own, where TRITON_INTERPRET is set before
    triton is imported: {case: {"max_error": float, ...} or {"error": traceback}}."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreted_results("tests.unit.triton_interpreted")


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


# What each kernel takes as a pointer, for compiling it without a GPU ("Q" is q's dtype, "KV" the pool's).
POINTERS = {
    "_decode_split_kernel": dict(Q="Q", K="KV", V="KV", Pages="i32", SeqLens="i32", MidOut="fp32", MidLse="fp32"),
    "_decode_merge_kernel": dict(MidOut="fp32", MidLse="fp32", Out="Q"),
    "_extend_kernel": dict(Q="Q", K="KV", V="KV", Pages="i32", QStarts="i32", QLens="i32", SeqLens="i32", Out="Q"),
}


@pytest.mark.parametrize("dtype, group, page_size", [("fp32", 4, 16), ("bf16", 8, 64)])
def test_the_kernels_compile_for_a_hopper_gpu(dtype, group, page_size, tmp_path, monkeypatch):
    """ptxas (shipped with triton) compiles each kernel for sm_90 at head_dim 128, with the wrappers' block
    sizes: the compiled path's checks the interpreter skips (tl.dot's minimum shapes, types, shared memory)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # its default, said aloud (triton 3.9 warns otherwise)
    from disagg_worker.model import triton_attention as kernels

    head_dim, precision = 128, "ieee" if dtype == "fp32" else "tf32"
    constexprs = {
        "_decode_split_kernel": dict(GROUP=group, PAGE_SIZE=page_size, BLOCK_H=max(16, group), BLOCK_N=32),
        "_decode_merge_kernel": dict(BLOCK_S=16),
        "_extend_kernel": dict(GROUP=group, PAGE_SIZE=page_size, BLOCK_M=32, BLOCK_N=32),
    }
    for name, pointers in POINTERS.items():
        fn = getattr(kernels, name)
        if not isinstance(fn, triton.JITFunction):
            pytest.skip("TRITON_INTERPRET is set in this process: the kernels are interpreted, not compiled")
        consts = {**constexprs[name], "BLOCK_D": head_dim}
        if "PRECISION" in fn.arg_names:
            consts["PRECISION"] = precision
        compiled = triton.compile(
            ASTSource(fn, _signature(fn, pointers, consts, dtype), consts), target=GPUTarget("cuda", 90, 32)
        )
        assert compiled.asm["cubin"] and compiled.metadata.shared < 200 * 1024


def _signature(fn, pointers: dict[str, str], consts: dict, dtype: str) -> dict[str, str]:
    """Triton's type of each argument: constexpr, a pointer (to q's or the pool's dtype), the fp32 scale, or i32."""

    def kind(arg: str) -> str:
        if arg in consts:
            return "constexpr"
        if arg in pointers:
            return "*" + (dtype if pointers[arg] in ("Q", "KV") else pointers[arg])
        return "fp32" if arg == "scale" else "i32"

    return {arg: kind(arg) for arg in fn.arg_names}
