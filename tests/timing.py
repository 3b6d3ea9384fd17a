"""How long a test waits, on this machine.

A test decides on observed state: it waits for the state it needs (a queue holding requests, a pod
Ready, /health draining) and asserts what that state implies. The only durations left are deadlines:
how long to wait before calling a state unreached, and the product's own promises ("refused within
5 s"). Both stretch when the machine is loaded, so every one is written through `scaled`, which
multiplies it by `DISAGG_TEST_TIME_FACTOR` (default 1). `make test-stress` keeps every core busy and
sets the factor, instead of every deadline being raised for the worst machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _factor() -> float:
    raw = os.environ.get("DISAGG_TEST_TIME_FACTOR", "1")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"DISAGG_TEST_TIME_FACTOR must be a number >= 1, not {raw!r}") from None
    if value < 1:
        raise ValueError(f"DISAGG_TEST_TIME_FACTOR must be a number >= 1, not {raw!r}")
    return value


FACTOR = _factor()


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on a quiet machine, stretched by the machine's time factor."""
    return seconds * FACTOR


def wait_until(pred: Callable[[], T], timeout: float = 30.0, interval: float = 0.2, what: str = "condition") -> T:
    """Poll `pred` until it returns something true and return that; `timeout` is scaled."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    last: T | None = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached in {limit:g}s (last: {last!r})")
