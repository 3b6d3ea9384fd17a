"""The gpu tier: the engine on a CUDA device. Every test here is marked `gpu` and skipped, saying why, where
torch sees no CUDA device (CI's machines); a GPU machine runs it with hack/gpu/run.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "no CUDA device here: the gpu tier runs on a GPU machine (hack/gpu/run.sh)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """The tiny random model of every architecture (make_tiny), built once."""
    from disagg_worker.model.tiny import _ARCH_CONFIGS, make_tiny

    return {arch: str(make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)) for arch in _ARCH_CONFIGS}
