"""Whether the adapters of --lora-modules fit a model, checked before any process starts: their files, their
ranks and their target modules' shapes, against the model built on the meta device (shapes, no weights)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.lora import check_adapters, read_adapters
from disagg_worker.model.parallel import Shard
from disagg_worker.model.registry import build_model


def check_fit(model_dir: Path, pairs: Sequence[tuple[str, str]], max_rank: int) -> None:
    """LoraError naming the first adapter (name, directory) that cannot be read or does not fit."""
    with torch.device("meta"):
        model = build_model(ModelConfig.from_hf_dir(model_dir), Shard())
    check_adapters(model, read_adapters(pairs), max_rank)
