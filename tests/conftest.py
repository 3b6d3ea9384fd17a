"""Fixtures shared by every tier: the embedded tiny model, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from disagg_worker.model.tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny-llama")
    make_tiny(out)
    return str(out)
