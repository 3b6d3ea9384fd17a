"""Merged projections: each Llama-family attention's q/k/v, and each gated MLP's gate/up (experts included), as
one GEMM over one weight, for CUDA.

A batch-1 decode step on a GPU is a string of small kernels, and three GEMVs over the same input cost three
launches where one would do. After loading, `merge_projections` stacks each module's weights (and biases) into one
tensor and makes the projections' own parameters views into it: no extra memory, the state dict keeps its names
and values, and an in-place update of a parameter (`load_state_dict` without `assign`) updates the merged weight.
The forward then runs one `F.linear` and splits its output (`layers.Merged`).

The loader merges only on CUDA (the CPU path's numerics stay as they are: packed oneDNN weights or int4 codes
there), on a single tensor rank, for a weight format that leaves the projections plain linear layers
(`formats.WeightFormat.merges_projections`). The merged tensor is not a parameter or buffer: moving
the model to another device after merging would leave it behind, so merge last.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg_worker.model.layers import GatedMLP, Merged
from disagg_worker.model.llama import LlamaAttention


def _plain(*modules: nn.Module) -> list[nn.Linear] | None:
    """The modules, if they are plain `nn.Linear`s of one dtype, device and input width, all with a bias or none."""
    linears = [m for m in modules if type(m) is nn.Linear]
    if len(linears) < len(modules):
        return None
    same = len({(m.weight.dtype, m.weight.device, m.in_features) for m in linears}) == 1
    biases = {m.bias is None for m in linears}
    return linears if same and len(biases) == 1 else None


def _merge(linears: list[nn.Linear]) -> Merged:
    """Stack the projections' weights (and biases) into one tensor, their parameters becoming views into it."""
    sizes = [m.out_features for m in linears]
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        biases = [m.bias.detach() for m in linears if m.bias is not None]
        bias = torch.cat(biases) if biases else None
    for m, w in zip(linears, weight.split(sizes), strict=True):
        m.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        for m, b in zip(linears, bias.split(sizes), strict=True):
            m.bias = nn.Parameter(b, requires_grad=False)
    return Merged(weight, bias, sizes)


def merge_projections(model: nn.Module) -> int:
    """Merge q/k/v of every `LlamaAttention` and gate/up of every `GatedMLP` of `model` whose projections are
    plain linear layers alike (not int4 or packed ones); returns how many modules were merged."""
    merged = 0
    for m in model.modules():
        if isinstance(m, LlamaAttention) and m.qkv is None and (qkv := _plain(m.q_proj, m.k_proj, m.v_proj)):
            m.qkv = _merge(qkv)
            merged += 1
        elif isinstance(m, GatedMLP) and m.gate_up is None and (gate_up := _plain(m.gate_proj, m.up_proj)):
            m.gate_up = _merge(gate_up)
            merged += 1
    return merged
