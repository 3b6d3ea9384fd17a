"""LoRA adapters applied per row: one batch mixes requests of several adapters and of the base model.

`LoraLayers.attach` checks each adapter against the model (its rank against --max-lora-rank, each module it
targets present with the shapes it has) and hooks every targeted projection: after the projection's own output
`y = W x`, the rows of adapter `s` get `(x A_s^T) B_s^T * scaling_s` added, one gather and two small GEMMs per
adapter present in the batch (a batch of the base alone costs nothing). A projection the loader merged into one
GEMM (`layers.Merged`: q/k/v, gate/up on CUDA) gets each part's delta added to its part of the merged output.

The projections keep their modules and names (a forward hook, not a subclass or a wrapper), so the state dict,
the weight formats and the merging stay as they are. `select` tells the hooks, once per forward, which rows run
under which slot (`ForwardBatch.lora_slots`: per request, 0 for the base). Every adapter is kept in host memory;
`max_loras` slots on the model's device hold the resident ones, adapter i in slot i from the start, another one
copied in by `load` (the scheduler chooses which: `engine/lora_registry.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from disagg_worker.model.layers import Merged
from disagg_worker.model.lora_files import Adapter, LoraError, read_adapter

log = logging.getLogger(__name__)

# A merged projection's attribute on its module, and the projections it holds, in order (`model/merged.py`).
MERGED_PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}

# Per adapter slot present in a forward: the indices of its rows (tokens) in the batch.
Segments = list[tuple[int, torch.Tensor]]


class LoraLayers:
    """The adapters of one model, in host memory, and those resident in its slots (on its device)."""

    def __init__(self, adapters: Sequence[Adapter], device: torch.device, dtype: torch.dtype):
        self.adapters = list(adapters)  # adapter i + 1 is adapters[i], its weights in host memory
        self.device, self.dtype = device, dtype
        self.weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}  # module -> slot -> ...
        self.segments: Segments = []

    @classmethod
    def attach(cls, model: nn.Module, adapters: Sequence[Adapter], max_rank: int, max_loras: int = 0) -> LoraLayers:
        """Check `adapters` against `model`, hook its projections and make the first `max_loras` (0: all)
        resident; LoraError naming the adapter otherwise."""
        check_adapters(model, adapters, max_rank)
        modules = dict(model.named_modules())
        param = next(model.parameters())
        layers = cls(adapters, param.device, param.dtype)
        for slot in range(1, min(max_loras or len(adapters), len(adapters)) + 1):
            layers.load(slot, slot)
        for name in sorted({name for adapter in adapters for name in adapter.weights}):
            modules[name].register_forward_hook(layers._hook(name))
        for name, module in modules.items():
            for attr, parts in MERGED_PARTS.items():
                merged = getattr(module, attr, None)
                if isinstance(merged, Merged):
                    names = [f"{name}.{p}" if name else p for p in parts]
                    setattr(module, attr, _MergedWithLora(merged, names, layers))
        return layers

    def load(self, slot: int, adapter: int) -> None:
        """Make `adapter` (from 1) resident in `slot`, in place of the one there. No forward in flight may read the
        slot: the scheduler hands it over only once no running request holds it."""
        for per_slot in self.weights.values():
            per_slot.pop(slot, None)
        held = self.adapters[adapter - 1]
        for name, (a, b) in held.weights.items():
            ab = (a.to(self.device, self.dtype), b.to(self.device, self.dtype), held.scaling)
            self.weights.setdefault(name, {})[slot] = ab
        log.info("LoRA adapter %s resident in slot %d", held.name, slot)

    def select(self, slots: Sequence[int] | None, extend_lens: Sequence[int], device: torch.device) -> None:
        """Which rows of the coming forward run under which adapter: request i's `extend_lens[i]` rows under
        `slots[i]` (None: every row under the base)."""
        self.segments = []
        if not slots or not any(slots):
            return
        per_row = torch.repeat_interleave(torch.tensor(slots), torch.tensor(extend_lens))
        for slot in sorted(set(slots) - {0}):
            self.segments.append((slot, torch.nonzero(per_row == slot).flatten().to(device)))

    def add_delta(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add, in place, the delta of projection `name` to the rows of `out` whose adapter targets it."""
        per_slot = self.weights.get(name)
        if per_slot is None:
            return
        for slot, rows in self.segments:
            ab = per_slot.get(slot)
            if ab is None:
                continue
            a, b, scaling = ab
            delta = (x.index_select(0, rows) @ a.t()) @ b.t()
            out.index_add_(0, rows, delta, alpha=scaling)

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if self.segments:
                self.add_delta(name, args[0], out)
            return out

        return hook


class _MergedWithLora:
    """A merged projection (`layers.Merged`) whose parts get their adapters' deltas."""

    def __init__(self, merged: Merged, names: list[str], lora: LoraLayers):
        self.merged, self.names, self.lora = merged, names, lora
        self.weight, self.bias, self.sizes = merged.weight, merged.bias, merged.sizes

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = self.merged(x)
        if self.lora.segments:
            for name, out in zip(self.names, outs, strict=True):
                self.lora.add_delta(name, x, out)
        return outs


def read_adapters(pairs: Sequence[tuple[str, str]]) -> list[Adapter]:
    """The adapters (name, directory) of --lora-modules, in order."""
    return [read_adapter(name, path) for name, path in pairs]


def check_adapters(model: nn.Module, adapters: Sequence[Adapter], max_rank: int) -> None:
    """LoraError naming the first adapter whose rank exceeds `max_rank` or that does not fit `model` (a model
    built on the meta device will do: only its modules' shapes are read)."""
    modules = dict(model.named_modules())
    for adapter in adapters:
        if adapter.rank > max_rank:
            raise LoraError(f"LoRA adapter {adapter.name}: rank {adapter.rank} exceeds --max-lora-rank {max_rank}")
        for name, (a, b) in adapter.weights.items():
            _check_fits(adapter.name, name, modules.get(name), a, b)


def _check_fits(adapter: str, name: str, module: nn.Module | None, a: torch.Tensor, b: torch.Tensor) -> None:
    """LoraError unless `module` is a projection of the model whose shapes `a` and `b` fit."""
    shape = (getattr(module, "out_features", None), getattr(module, "in_features", None))
    if module is None or None in shape:
        raise LoraError(f"LoRA adapter {adapter}: it targets {name}, which is not a projection of this model")
    if (b.shape[0], a.shape[1]) != shape:
        raise LoraError(
            f"LoRA adapter {adapter}: {name} is [{shape[0]}, {shape[1]}] in the model, the adapter's delta "
            f"[{b.shape[0]}, {a.shape[1]}]"
        )
