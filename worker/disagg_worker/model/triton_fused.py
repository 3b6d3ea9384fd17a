"""Fused elementwise kernels for CUDA, as Triton kernels: RMSNorm, SiLU-and-multiply and rotary embedding, each
one launch where the torch path takes several (a decode step on a GPU is a string of small kernels; each launch
costs ~2-3 us even replayed from a CUDA graph).

Each kernel rounds where the torch path does, so the results match it bit for bit or within one unit in the last
place (the sums' order, and `exp`, may differ):
- `rms_norm` is `layers.RMSNorm.forward`: normalise in float32, cast to x's dtype, then multiply by the weight in
  the two dtypes' promoted type (a bfloat16 product rounded once, as torch's elementwise multiply rounds it).
- `silu_and_mul` is `F.silu(gate) * up` in their dtype: silu in float32 rounded to the dtype, then the product
  rounded again.
- `rope` is `rope.Rotation.__call__` (rotate-half layout) over q and k in one launch: `x * cos` and
  `rotate_half(x) * sin` each rounded to the dtype, then their sum.

Rows may be strided (gate and up as the two halves of a merged gate/up output; no copy). The layers call these
only on CUDA tensors, so the CPU path never imports this module; tests run the kernels on CPU tensors under
Triton's interpreter (tests/unit/triton_fused_interpreted.py) and tests/gpu/test_cuda_engine.py on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """float32 x rounded to `dtype` (bfloat16: to nearest even, by its bits; float32: x), as float32. A plain
    `x.to(dtype).to(tl.float32)` is folded away by the compiler (measured on an H200), and the interpreter
    truncates where a GPU rounds."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _rms_norm_kernel(X, W, Out, x_row_stride, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = _round(x * rstd, X.dtype.element_ty)  # cast back to x's dtype before the weight
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * n + cols, _round(w * normed, Out.dtype.element_ty).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(G, U, Out, g_row_stride, u_row_stride, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(G + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), Out.dtype.element_ty)  # F.silu rounds to the dtype
    tl.store(Out + row * n + cols, _round(silu * u, Out.dtype.element_ty).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, Cos, Sin, QOut, KOut, q_token_stride, q_head_stride, k_token_stride, k_head_stride, heads, kv_heads,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    token, head = tl.program_id(0), tl.program_id(1)
    if head < heads:
        src = Q + token * q_token_stride + head * q_head_stride
        dst = QOut + (token * heads + head) * 2 * HALF
    else:
        src = K + token * k_token_stride + (head - heads) * k_head_stride
        dst = KOut + (token * kv_heads + head - heads) * 2 * HALF
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    x1 = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = QOut.dtype.element_ty
    c1 = tl.load(Cos + token * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + token * 2 * HALF + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + token * 2 * HALF + cols, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + token * 2 * HALF + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to the dtype as torch's ops round them
    out1 = _round(_round(x1 * c1, dtype) + _round(-x2 * s1, dtype), dtype)
    out2 = _round(_round(x2 * c2, dtype) + _round(x1 * s2, dtype), dtype)
    tl.store(dst + cols, out1.to(dtype), mask=mask)
    tl.store(dst + HALF + cols, out2.to(dtype), mask=mask)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope.Rotation.__call__`: q [T, H, D] and k [T, H_kv, D] (strided tokens and heads allowed, unit stride
    within a head) rotated by cos/sin [T, 1, D] in their dtype (rotate-half layout); new contiguous tensors."""
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=q.device),
        torch.empty(k.shape, dtype=q.dtype, device=k.device),
    )
    if t == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    half = d // 2
    _rope_kernel[(t, heads + kv_heads)](
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads, kv_heads,
        HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1,
    )  # fmt: skip
    return q_out, k_out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit column stride (a view where one exists, else a copy)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.RMSNorm.forward(x)` with its `weight` and `eps`: a new contiguous tensor of x's shape, in x's and
    the weight's promoted dtype."""
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = _rows(x)
    if rows.shape[0] == 0:
        return out
    block = triton.next_power_of_2(n)
    num_warps = min(max(block // 256, 1), 16)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), n, eps, BLOCK=block, num_warps=num_warps)
    return out


SILU_BLOCK = 1024


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` for two tensors of one shape and dtype (rows may be strided, e.g. the halves of a
    merged gate/up output): a new contiguous tensor."""
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g, u = _rows(gate), _rows(up)
    if g.shape[0] == 0:
        return out
    grid = (g.shape[0], triton.cdiv(n, SILU_BLOCK))
    _silu_and_mul_kernel[grid](g, u, out, g.stride(0), u.stride(0), n, BLOCK=SILU_BLOCK, num_warps=4)
    return out
