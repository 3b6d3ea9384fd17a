"""Fixtures of the model tests (a pytest plugin: `pytest_plugins = ["tests.unit.conftest_model"]`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disagg_worker.model.tiny import make_tiny
from tests.unit.model_stubs import ARCHS


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(root / arch, seed=0, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run far faster on one thread than on a shared, oversubscribed CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
