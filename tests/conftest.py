"""Fixtures shared by every tier: the embedded tiny model, built once per session."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

# Property tests run on loaded machines too: no per-example deadline and no "too slow to generate" check,
# which measure the machine, not the property. A test's own @settings still chooses its number of examples.
settings.register_profile("disagg", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("disagg")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from disagg_worker.model.tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny-llama")
    make_tiny(out)
    return str(out)
