"""`--quantization int4`: the attention and MLP projections as 4-bit codes for torch's CPU int4 kernel, on a CPU in
bfloat16. The scheme, the layer and what is quantised are `int4_linear.py`'s, which this format imports only when
it is applied (it needs torch; the configuration checks the format without it)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from disagg_worker.errors import ConfigError
from disagg_worker.model.formats.base import Placement

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)


class Int4:
    """llama.cpp's Q4_1 (a scale and a minimum per 32 weights) on `aten._weight_int4pack_mm_for_cpu`."""

    name = "int4"
    help = (
        "attention and MLP projections as 4-bit weights with a scale and minimum per 32 (llama.cpp's Q4_1) for "
        "torch's CPU int4 kernel; needs --dtype bfloat16. The projections read 0.625 bytes a weight instead of 2 "
        "(concurrency 1 on SmolLM2: 1.36x bfloat16's tok/s in bench/bench_cpu_chat.py); answers are the bfloat16 "
        "engine's up to the weights' rounding"
    )
    merges_projections = False  # its projections are Int4Linear layers, not weights a GEMM can stack

    def check(self, config: Placement) -> None:
        """The kernel takes bfloat16 activations, on a CPU."""
        if config.dtype != "bfloat16" or config.device != "cpu":
            raise ConfigError(
                f"--quantization {self.name} runs on a CPU in bfloat16 (torch's CPU int4 kernel takes "
                f"bfloat16 activations): pass --dtype bfloat16 --device cpu (here {config.dtype} on {config.device})"
            )

    def apply(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Swap the quantisable projections for `Int4Linear`s (ValueError where this torch has no such kernel)."""
        from disagg_worker.model.formats.int4_linear import check_int4_kernel, quantize_linears

        check_int4_kernel()
        swapped, kept = quantize_linears(model)
        log.info(
            "int4: %d projections in 4 bits, %d kept in %s (widths the kernel does not take)", swapped, kept, dtype
        )
