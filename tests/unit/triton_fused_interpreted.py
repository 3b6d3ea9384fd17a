"""The cases of test_triton_fused.py, run by `python -m tests.unit.triton_fused_interpreted` with TRITON_INTERPRET=1
(set before triton is first imported: see triton_interpreted.py). Each case compares a kernel of
`model/triton_fused.py` with the torch path it replaces (`layers.RMSNorm`'s CPU forward, `F.silu(g) * u`) on CPU
tensors and returns the largest difference; `main` prints every case's result as one JSON line."""

from __future__ import annotations

import json
import os
import traceback
from functools import partial

import torch
import torch.nn.functional as F

from disagg_worker.model.layers import RMSNorm

# float32: a different order of the sum of squares; bfloat16: one unit in the last place (the kernels round by the
# bits, so the interpreter's truncating casts do not come into it).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}


def rms_norm(rows: int, dim: int, dtype: torch.dtype, strided: bool = False) -> float:
    from disagg_worker.model.triton_fused import rms_norm as fused

    gen = torch.Generator().manual_seed(rows * 1000 + dim)
    norm = RMSNorm(dim, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    x = (3 * torch.randn(rows, 2 * dim if strided else dim, generator=gen)).to(dtype)
    x = x[:, dim:] if strided else x  # rows strided, as a view of a merged output is
    expected = norm(x)
    got = fused(x, norm.weight, norm.eps)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL[dtype])
    return float((got.float() - expected.float()).abs().max())


def rms_norm_heads(dtype: torch.dtype) -> float:
    """Per-head q/k norm: [T, H, D] over the last dimension, a view into a wider row."""
    from disagg_worker.model.triton_fused import rms_norm as fused

    norm = RMSNorm(16, 1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 16).to(dtype)
    x = torch.randn(5, 3 * 4 * 16, generator=torch.Generator().manual_seed(1)).to(dtype)[:, 16:80].view(5, 4, 16)
    expected = norm(x)
    got = fused(x, norm.weight, norm.eps)
    torch.testing.assert_close(got, expected, **TOL[dtype])
    return float((got.float() - expected.float()).abs().max())


def silu_and_mul(rows: int, size: int, dtype: torch.dtype) -> float:
    """Over the two halves of a merged [rows, 2 * size] gate/up output."""
    from disagg_worker.model.triton_fused import silu_and_mul as fused

    gate_up = (4 * torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(size))).to(dtype)
    gate, up = gate_up.split(size, dim=-1)
    expected = F.silu(gate) * up
    got = fused(gate, up)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **TOL[dtype])
    return float((got.float() - expected.float()).abs().max())


def rope(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> float:
    """q and k as views into a merged q/k/v output, rotated at scattered positions."""
    from disagg_worker.model.config import ModelConfig
    from disagg_worker.model.rope import RotaryEmbedding
    from disagg_worker.model.triton_fused import rope as fused

    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": heads * dim,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "vocab_size": 32,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
        }
    )
    gen = torch.Generator().manual_seed(tokens * heads + dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    rotation = RotaryEmbedding(cfg).at(torch.randint(0, 512, (tokens,), generator=gen), dtype)
    expected = rotation(q, k)
    got = fused(q, k, rotation.cos, rotation.sin)
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=0.0, rtol=0.0)  # every rounding as torch's
    worst = 0.0
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, **tol)
        worst = max(worst, float((g.float() - e.float()).abs().max()))
    return worst


def empty() -> float:
    from disagg_worker.model.triton_fused import rms_norm as fused
    from disagg_worker.model.triton_fused import silu_and_mul as fused_mul

    assert fused(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    assert fused_mul(torch.empty(0, 8), torch.empty(0, 8)).shape == (0, 8)
    return 0.0


def interpreted() -> float:
    from triton.runtime.interpreter import InterpretedFunction

    from disagg_worker.model import triton_fused as kernels

    for kernel in (kernels._rms_norm_kernel, kernels._silu_and_mul_kernel, kernels._rope_kernel):
        assert isinstance(kernel, InterpretedFunction), type(kernel)
    return 0.0


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = {
    "interpreted": interpreted,
    "empty": empty,
    **{f"rms_norm {r}x{d} {n}": partial(rms_norm, r, d, t) for r, d in ((1, 64), (7, 96)) for n, t in DTYPES.items()},
    **{f"rms_norm strided {n}": partial(rms_norm, 3, 64, t, True) for n, t in DTYPES.items()},
    **{f"rms_norm heads {n}": partial(rms_norm_heads, t) for n, t in DTYPES.items()},
    **{
        f"rope {t}x{h}/{kv}x{d} {n}": partial(rope, t, h, kv, d, dt)
        for t, h, kv, d in ((1, 4, 2, 16), (5, 8, 1, 64))
        for n, dt in DTYPES.items()
    },
    **{
        f"silu_and_mul {r}x{s} {n}": partial(silu_and_mul, r, s, t)
        for r, s in ((1, 80), (4, 1500))
        for n, t in DTYPES.items()
    },
}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, case in CASES.items():
        try:
            with torch.no_grad():
                results[name] = {"max_error": case()}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
