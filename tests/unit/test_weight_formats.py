"""The weight formats' registry (`model/formats/`): what `--quantization` takes, lists and refuses is what the
registry holds, each format's check refuses what its kernels cannot run, and the loader merges projections only
for a format that leaves them plain. Nothing here names a format but where a test is about that one."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from disagg_api import settings as S
from disagg_worker.cli import build_parser
from disagg_worker.cli_args import server_args_from_cli
from disagg_worker.config import EngineConfig, Role
from disagg_worker.env import load_env
from disagg_worker.errors import ConfigError
from disagg_worker.model.formats import FORMATS, weight_format
from disagg_worker.model.llama import LlamaAttention
from disagg_worker.model.loader import fit_to_device, load_model
from disagg_worker.model.parallel import Shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")
pytest_plugins = ["tests.unit.conftest_model"]
INT4_REFUSAL = (
    "--quantization int4 runs on a CPU in bfloat16 (torch's CPU int4 kernel takes bfloat16 activations): "
    "pass --dtype bfloat16 --device cpu (here {dtype} on {device})"
)
PLACEMENTS = [(dtype, device) for device in ("cpu", "cuda") for dtype in S.DTYPES]


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def quantization_action() -> argparse.Action:
    return next(a for a in serve_parser()._actions if S.QUANTIZATION.flag in a.option_strings)


def test_the_flags_choices_are_the_registered_formats_and_help_tells_each():
    assert quantization_action().choices == list(FORMATS)
    assert runs_in("") == PLACEMENTS and FORMATS[""].merges_projections  # the default: the weights as loaded
    flat = "".join(serve_parser().format_help().split())  # its lines may break at a hyphen as well as at a space
    assert all("".join(f.help.split()) in flat for f in FORMATS.values())


def runs_in(name: str) -> list[tuple[str, str]]:
    """The (dtype, device) pairs whose configuration the format's check accepts."""
    accepted = []
    for dtype, device in PLACEMENTS:
        try:
            FORMATS[name].check(SimpleNamespace(dtype=dtype, device=device))
        except ConfigError:
            continue
        accepted.append((dtype, device))
    return accepted


@pytest.mark.parametrize("name", FORMATS)
def test_every_registered_format_is_accepted_by_the_command_line_and_the_configuration(name):
    assert runs_in(name), f"--quantization {name} refuses every dtype on a CPU and on CUDA"
    for dtype, device in runs_in(name):
        argv = ["serve", "--model", "m", "--dtype", dtype, "--device", device, S.QUANTIZATION.flag, name]
        engine = server_args_from_cli(build_parser().parse_args(argv), Role.MONOLITHIC, load_env({})).engine
        assert (engine.quantization, engine.dtype, engine.device) == (name, dtype, device)
        assert EngineConfig(model_path="m", dtype=dtype, device=device, quantization=name).quantization == name
    assert weight_format(name) is FORMATS[name]


def test_an_unknown_format_is_refused_naming_the_known_ones(capsys):
    known = [name for name in FORMATS if name]
    with pytest.raises(ConfigError, match=f"^--quantization int8: one of {', '.join(known)}$"):
        EngineConfig(model_path="m", dtype="bfloat16", quantization="int8")
    with pytest.raises(ConfigError, match="^--quantization int8: one of "):
        weight_format("int8")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", S.QUANTIZATION.flag, "int8"])
    err = capsys.readouterr().err
    assert "invalid choice: 'int8'" in err and all(repr(name) in err for name in FORMATS)


@pytest.mark.parametrize(("dtype", "device"), [("float32", "cpu"), ("float16", "cpu"), ("bfloat16", "cuda")])
def test_int4_outside_bfloat16_on_a_cpu_is_refused_with_the_flags_to_pass(dtype, device):
    want = INT4_REFUSAL.format(dtype=dtype, device=device)
    with pytest.raises(ConfigError) as refused:
        EngineConfig(model_path="m", dtype=dtype, device=device, quantization="int4")
    assert str(refused.value) == want
    with pytest.raises(ConfigError) as refused:
        FORMATS["int4"].check(SimpleNamespace(dtype=dtype, device=device))
    assert str(refused.value) == want
    EngineConfig(model_path="m", dtype=dtype, device=device)  # the weights as loaded run anywhere
    assert runs_in("int4") == [("bfloat16", "cpu")]


class Recorded:
    """A format a test registers nowhere: what `fit_to_device` asks of it, and projections it keeps unmerged."""

    name = "recorded"
    help = "a test's"
    merges_projections = False

    def __init__(self) -> None:
        self.applied: list[torch.dtype] = []

    def check(self, config: object) -> None:
        pass

    def apply(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.applied.append(dtype)


def test_the_loader_applies_the_format_and_merges_projections_only_where_it_leaves_them_plain(tiny_dirs):
    """Merging runs for CUDA only; it is device-agnostic, so CPU weights stand in for a GPU's here."""
    cuda = torch.device("cuda")
    plain, _ = load_model(tiny_dirs["llama"], "float32", "cpu")
    fit_to_device(plain, cuda, torch.float32, Shard(), weight_format(""))
    assert all(m.qkv is not None for m in plain.modules() if isinstance(m, LlamaAttention))

    fmt = Recorded()
    kept, _ = load_model(tiny_dirs["llama"], "float32", "cpu")
    fit_to_device(kept, cuda, torch.float32, Shard(), fmt)
    assert fmt.applied == [torch.float32]
    assert all(m.qkv is None for m in kept.modules() if isinstance(m, LlamaAttention))
