"""Integration fixtures: no process a test module started outlives it."""

from __future__ import annotations

import pytest

from tests.integration.procs import Proc


@pytest.fixture(scope="module", autouse=True)
def no_process_left_behind():
    """After the module's own fixtures have stopped what they started, stop whatever a failed test left
    running (its process group: the HTTP process and every rank's scheduler process)."""
    yield
    for proc in Proc.started:
        if proc.proc.poll() is None:
            proc.stop()
    Proc.started.clear()
