"""make_tiny: deterministic, small, loadable, and not degenerate."""

from __future__ import annotations

import pytest

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.tiny import make_tiny
from disagg_worker.model.tokenizer import Tokenizer
from tests.unit.model_stubs import ARCHS

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

pytest_plugins = ["tests.unit.conftest_model"]


def test_same_seed_gives_byte_identical_files(tiny_dirs, tmp_path):
    again = make_tiny(tmp_path / "again", seed=0, arch="llama")
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dirs["llama"] / name).read_bytes(), name


def test_other_seed_gives_other_weights_same_tokenizer(tiny_dirs, tmp_path):
    other = make_tiny(tmp_path / "other", seed=1, arch="llama")
    assert (other / "model.safetensors").read_bytes() != (tiny_dirs["llama"] / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dirs["llama"] / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_are_small_and_of_the_asked_family(tiny_dirs, arch):
    path = tiny_dirs[arch]
    assert sum((path / name).stat().st_size for name in FILES) < 10 * 1024 * 1024
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.arch == arch
    assert Tokenizer.from_dir(path).vocab_size == cfg.vocab_size


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="gpt2"):
        make_tiny(tmp_path, arch="gpt2")
