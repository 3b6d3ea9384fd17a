"""The fused Triton kernels (`model/triton_fused.py`: RMSNorm, SiLU-and-multiply) equal the torch path they
replace, run on CPU tensors under Triton's interpreter in a subprocess (`triton_fused_interpreted.py`: see
test_triton_attention.py for why), in float32 and bfloat16; and the CPU path never reaches them.
tests/gpu/test_cuda_engine.py compares the compiled kernels on CUDA."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from disagg_worker.model.layers import GatedMLP, RMSNorm
from tests.unit.test_triton_attention import interpreted_results
from tests.unit.triton_fused_interpreted import CASES


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreted_results("tests.unit.triton_fused_interpreted")


@pytest.mark.parametrize("case", CASES)
def test_interpreted_kernel_case(results, case):
    result = results[case]
    assert "error" not in result, result["error"]


def test_the_cpu_path_does_not_reach_triton(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a fused Triton kernel ran on the CPU")

    stub = types.SimpleNamespace(rms_norm=refuse, silu_and_mul=refuse)
    monkeypatch.setitem(sys.modules, "disagg_worker.model.triton_fused", stub)
    x = torch.randn(3, 16)
    assert RMSNorm(16, 1e-6)(x).shape == (3, 16)
    assert GatedMLP(16, 32)(x).shape == (3, 16)


# Each kernel's pointers: "T" the tensors' dtype, "F" the weight's (as the tensors' here).
KERNELS = {
    "_rms_norm_kernel": (dict(X="T", W="T", Out="T"), dict(BLOCK=4096)),
    "_silu_and_mul_kernel": (dict(G="T", U="T", Out="T"), dict(BLOCK=1024)),
    "_rope_kernel": (dict(Q="T", K="T", Cos="T", Sin="T", QOut="T", KOut="T"), dict(HALF=64, BLOCK=64)),
}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", KERNELS)
def test_the_kernels_compile_for_a_hopper_gpu(name, dtype, tmp_path, monkeypatch):
    """ptxas (shipped with triton) compiles each kernel for sm_90: the compiled path's checks the interpreter skips."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    from disagg_worker.model import triton_fused as kernels

    fn = getattr(kernels, name)
    if not isinstance(fn, triton.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: the kernels are interpreted, not compiled")
    pointers, consts = KERNELS[name]

    def kind(arg: str) -> str:
        if arg in consts:
            return "constexpr"
        if arg in pointers:
            return "*" + dtype
        return "fp32" if arg == "eps" else "i32"

    signature = {arg: kind(arg) for arg in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
