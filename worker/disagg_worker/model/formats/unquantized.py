"""`--quantization ""` (the default): the null format, the weights as loaded, in `--dtype`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from disagg_worker.model.formats.base import Placement

if TYPE_CHECKING:
    import torch
    from torch import nn


class Unquantized:
    """The weights as the checkpoint gave them, in `--dtype`, on any device."""

    name = ""
    help = "the weights in --dtype, as loaded (the default)"
    merges_projections = True

    def check(self, config: Placement) -> None:
        """Any dtype on any device."""

    def apply(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Nothing to change."""
