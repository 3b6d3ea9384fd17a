"""Weight formats by `--quantization` value: how a loaded model's weights are held (`WeightFormat`, `base.py`).

Every model is built and filled in `--dtype`; the loader then hands it to its format (`loader.fit_to_device`:
`fmt.apply(model, dtype)`, then the packing and merging every format shares) before the engine runs it:

- "" (the default, `unquantized.py`): the null format, the weights as loaded;
- "int4" (`int4.py`, its layers and scheme in `int4_linear.py`): the attention and MLP projections as 4-bit
  codes for torch's CPU int4 kernel, on a CPU in bfloat16.

`FORMATS` is the one list of them. The engine commands take its names as `--quantization`'s choices and each
member's `help` in --help (`cli_args.add_engine_args`); the configuration looks the value up here (an unknown one
is refused naming the known ones) and runs the member's `check` against `--dtype` and `--device` at start-up
(`EngineConfig`); the loader applies it. This module and the members' own modules import no torch (the HTTP
process checks the configuration without it): a member imports its kernels inside `apply`.

Adding a format (FP8 next, LoRA later) is one new file plus its registration:

1. `formats/fp8.py`: a class with `WeightFormat`'s members: `name = "fp8"`, a `help` line, whether the loader may
   still merge q/k/v and gate/up (`merges_projections`), `check` (refuse, as a ConfigError naming the flags to
   change, a dtype or device its kernels do not take) and `apply` (swap the model's layers in place; torch and
   the kernels imported inside it, or from a module of the format's own that only `apply` imports);
2. its instance in `_MEMBERS` below.

`--quantization fp8` is then accepted by the command line and the configuration, listed in --help, named in the
error for an unknown value, and applied at load; `tests/unit/test_weight_formats.py` checks the first three for
every member of `FORMATS` (what a format computes is its own test module's, as `test_quant.py` is int4's).
"""

from __future__ import annotations

from disagg_api import settings as S
from disagg_worker.errors import ConfigError
from disagg_worker.model.formats.base import Placement as Placement
from disagg_worker.model.formats.base import WeightFormat as WeightFormat
from disagg_worker.model.formats.int4 import Int4
from disagg_worker.model.formats.unquantized import Unquantized

_MEMBERS: tuple[WeightFormat, ...] = (Unquantized(), Int4())
FORMATS: dict[str, WeightFormat] = {f.name: f for f in _MEMBERS}


def weight_format(name: str) -> WeightFormat:
    """The format `--quantization name` names; ConfigError naming the known ones."""
    if name not in FORMATS:
        known = ", ".join(n for n in FORMATS if n)
        raise ConfigError(f"{S.QUANTIZATION.flag} {name}: one of {known}")
    return FORMATS[name]


def choices() -> dict[str, str]:
    """`--quantization`'s values, each with what --help says of it, in registration order."""
    return {name: f.help for name, f in FORMATS.items()}
