"""LoRA adapters in PEFT's format, read from disk: `adapter_config.json` and `adapter_model.safetensors`.

PEFT saves, for each projection an adapter targets, `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); the module names are the Hugging Face checkpoint's, which are this model's too
(`model/decoder.py`). The delta of a projection is `B @ A` scaled by `lora_alpha / r` (rsLoRA:
`lora_alpha / sqrt(r)`). What this reader does not apply (DoRA, trained biases, modules saved whole, per-module
ranks or alphas, transposed weights) is refused with the reason, never half-applied.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

PREFIX = "base_model.model."
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


class LoraError(ValueError):
    """An adapter that cannot be served: the message names it and why."""


@dataclass(frozen=True)
class Adapter:
    name: str
    rank: int
    scaling: float
    # Per targeted module (its name in the model): A [r, in] and B [out, r].
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


# Config entries whose non-default values change what the adapter computes, and what they must be here.
_REFUSED = {
    "use_dora": (False, "DoRA"),
    "fan_in_fan_out": (False, "fan_in_fan_out weights"),
    "lora_bias": (False, "trained LoRA biases"),
    "rank_pattern": ({}, "per-module ranks (rank_pattern)"),
    "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
}


def read_adapter(name: str, path: str | Path) -> Adapter:
    """The adapter `name` saved by PEFT in the directory `path`; LoraError naming the file and the reason."""
    where = Path(path)
    config = _config(name, where / CONFIG)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoraError(f"LoRA adapter {name}: {where / CONFIG}: r and lora_alpha must be numbers (r >= 1)")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return Adapter(name, rank, scaling, _weights(name, where / WEIGHTS, rank))


def _config(name: str, file: Path) -> dict:
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name}: cannot read {file}: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name}: {file} is not a LoRA adapter's config (peft_type LORA)")
    for key, (plain, what) in _REFUSED.items():
        if config.get(key) not in (plain, None):
            raise LoraError(f"LoRA adapter {name}: {file}: {what}: not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoraError(f"LoRA adapter {name}: {file}: trained biases and modules_to_save: not supported")
    return config


def _weights(name: str, file: Path, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    try:
        tensors = load_file(str(file))
    except Exception as e:  # a missing or corrupt file: safetensors raises its own errors
        raise LoraError(f"LoRA adapter {name}: cannot read {file}: {e}") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, dot, part = key.removeprefix(PREFIX).rpartition(".lora_")
        if not dot or part not in ("A.weight", "B.weight") or t.dim() != 2:
            raise LoraError(f"LoRA adapter {name}: {file}: {key} is not a projection's lora_A or lora_B weight")
        parts.setdefault(module, {})[part[0]] = t
    weights = {}
    for module, ab in parts.items():
        missing = {"A", "B"} - set(ab)
        if missing:
            raise LoraError(f"LoRA adapter {name}: {file}: {module} lacks its lora_{missing.pop()} weight")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"LoRA adapter {name}: {file}: {module}'s weights are not of rank r={rank}")
        weights[module] = (a, b)
    if not weights:
        raise LoraError(f"LoRA adapter {name}: {file} holds no LoRA weights")
    return weights
