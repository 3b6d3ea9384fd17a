"""Weight-only 4-bit linear layers for a CPU decode step bound by memory bandwidth: the kernel-level half of
`--quantization int4` (the format, its check and its swap: `int4.py`).

A batch-1 decode step reads every weight once: SmolLM2-135M's projections are 212 MB in bfloat16, and
a 2-core EPYC streams them at ~15-35 GB/s, so the step's matmuls cost ~12 ms whatever the kernel does.
Four bits per weight and a 16-bit scale and zero per 32 weights are 0.625 bytes a weight against 2: the
projections' 212 MB become 66 MB (the bfloat16 LM head, 57 MB, stays). The scheme is llama.cpp's Q4_1: each group of 32
consecutive input weights of an output row keeps a scale and a minimum, weight = minimum + scale * q
with q in 0..15 (the minimum and the maximum of the group are exact). torch's CPU int4 kernel
(`aten._weight_int4pack_mm_for_cpu`, the one torchao's weight-only int4 runs on) computes exactly
that form, written `(q - 8) * scale + zero` with `zero = minimum + 8 * scale`, over bfloat16
activations; its packed layout is made once at load.

Quantising weights that were dequantised from a Q4_1 GGUF (what `make serve`'s converted demo model
holds) finds the file's own codes again: each group's minimum and maximum are its q = 0 and q = 15
values, so every weight lands within a rounding error of its integer. What changes is the precision
of scale and minimum (bfloat16 in the kernel, float16 in the file) and of the sums (bfloat16
activations): answers are the bfloat16 engine's, not float32 transformers', as with `--dtype bfloat16`.

What is quantised: the projections of Llama-family attention (q, k, v, o) and of every gated MLP
(dense layers and experts), where the shard's input width is a multiple of 32 and its output width
one of 16 (the kernel's tiles). The LM head, the
embedding, MLA's projections (their absorbed products are derived from the weights at load), routers
and EAGLE's fc keep `--dtype`.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg_worker.model.layers import GatedMLP
from disagg_worker.model.llama import LlamaAttention

GROUP = 32
OUT_TILE = 16
LEVELS = 15  # q in 0..15
_INNER_K_TILES = 2


def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 of a [out, in] weight (in a multiple of GROUP): codes [out, in] (int32, 0..15), and per group
    of GROUP inputs the scale and the minimum [out, in / GROUP] (float32); weight ~ minimum + scale * code."""
    out, width = w.shape
    g = w.detach().float().reshape(out, width // GROUP, GROUP)
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low) / LEVELS
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = ((g - low[..., None]) * inverse[..., None]).round().clamp(0, LEVELS).to(torch.int32)
    return codes.reshape(out, width), scale, low


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The float32 weight the codes stand for."""
    out, width = codes.shape
    g = codes.float().reshape(out, width // GROUP, GROUP)
    return (low[..., None] + scale[..., None] * g).reshape(out, width)


def can_quantize(linear: nn.Linear) -> bool:
    """The kernel's shapes: inputs in whole groups, outputs in tiles of OUT_TILE."""
    fits = linear.in_features % GROUP == 0 and linear.out_features % OUT_TILE == 0
    return fits and linear.weight.device.type == "cpu"


class Int4Linear(nn.Module):
    """`nn.Linear`'s forward over Q4_1 codes packed for torch's CPU int4 kernel (bfloat16 in and out; the
    packed weight and its scales are buffers, not parameters)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scale, low = quantize_groups(linear.weight)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES))
        zero = low + (LEVELS + 1) / 2 * scale
        # [in / GROUP, out, 2]: the kernel's layout of (scale, zero) per group.
        self.register_buffer("scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().bfloat16(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _quantizable(parent: nn.Module) -> bool:
    return isinstance(parent, (LlamaAttention, GatedMLP))


def quantize_linears(model: nn.Module) -> tuple[int, int]:
    """Replace the quantisable `nn.Linear`s of `model` (see the module's docstring) with `Int4Linear`s;
    returns (how many were replaced, how many of their kind were kept for shapes the kernel does not take)."""
    # (parent, name) only: a 16-bit weight is freed as soon as its replacement exists.
    candidates = [
        (parent, name)
        for parent in model.modules()
        if _quantizable(parent)
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    swapped = 0
    for parent, name in candidates:
        child = getattr(parent, name)
        if can_quantize(child):
            setattr(parent, name, Int4Linear(child))
            swapped += 1
        del child
    return swapped, len(candidates) - swapped


def check_int4_kernel() -> None:
    """Raise ValueError naming the need where this torch has no CPU int4 kernel (it came with torch 2.6)."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise ValueError(
            f"--quantization int4 needs torch 2.6 or later (its CPU int4 kernel); this is {torch.__version__}"
        )
