"""Fixtures shared by every tier: the embedded tiny model, built once per session."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.phases import pytest_runtest_logreport, pytest_runtest_logstart, pytest_terminal_summary
from tests.timing import FACTOR, scaled

__all__ = ["pytest_runtest_logreport", "pytest_runtest_logstart", "pytest_terminal_summary"]  # the tier report's hooks

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


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "soak: P/D answers against monolithic ones under load and kill -9 (SOAK_SECONDS, SOAK_CLIENTS)"
    )


def pytest_collection_modifyitems(config, items):
    """pytest-timeout's limit for a test (pyproject.toml) stretches with the machine's time factor, like every
    other deadline; a test's own timeout mark is scaled where it is written."""
    limit = scaled(float(config.getini("timeout") or 0))
    if FACTOR == 1 or not limit:
        return
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(limit))
