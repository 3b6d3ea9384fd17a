"""What a weight format is (`WeightFormat`) and what its check reads of the engine's configuration (`Placement`).

Torch is named for the types only: the configuration checks a format in processes that never import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn


class Placement(Protocol):
    """Where the weights will run, as a format's check reads it (`EngineConfig` is one)."""

    @property
    def dtype(self) -> str:
        """`--dtype`: the weights' and the activations' dtype as loaded ("float32", "bfloat16", "float16")."""
        ...

    @property
    def device(self) -> str:
        """`--device`: "cpu", "cuda", ..."""
        ...


class WeightFormat(Protocol):
    """One value of `--quantization`: how a loaded model's weights are held."""

    name: str  # the value of --quantization that names it
    help: str  # what the engine commands' --help says of it
    # Whether the loader may merge q/k/v and gate/up into one weight each on CUDA (`merged.py`): only where the
    # format leaves them as plain linear layers.
    merges_projections: bool

    def check(self, config: Placement) -> None:
        """Raise ConfigError, naming the flags to change, where the format cannot run in `config`'s dtype on its
        device (at start-up, before any weight is read)."""
        ...

    def apply(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Put the loaded `model`'s weights (in `dtype`, on their device) into this format, in place."""
        ...
