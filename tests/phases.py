"""Where a test run's time goes: each tier's wall time and its slowest tests.

A tier is the directory under tests/ a test lives in (unit, integration, cluster, e2e, ...). Its wall time runs
from the start of its first test's set-up to the end of its last test's teardown, so a session fixture that a
tier's first test starts (a cluster, a node) is counted in that tier. The section is printed at the end of
pytest's summary, and written as JSON to $DISAGG_TIER_REPORT where that is set (`make test` sets it;
hack/test/report.py prints it with the build's phases). Under pytest-xdist the hooks run in the controlling
process, from the reports its workers send, so a tier's wall time is still the time from its first start to its
last end.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported without pytest too: hack/test/report.py renders with render()
    import pytest

SLOWEST = 10
_TESTS = Path(__file__).resolve().parent


@dataclass
class Tier:
    """One tier's tests as they ran."""

    first: float = 0.0
    last: float = 0.0
    tests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # test id -> set-up + call + teardown


_TIERS: dict[str, Tier] = {}
_CURRENT: dict[str, float] = {}


def tier_of(path: str | os.PathLike[str]) -> str:
    """The directory under tests/ that a test file lives in ("tests" for one directly in it)."""
    parts = Path(path).resolve().relative_to(_TESTS).parts
    return parts[0] if len(parts) > 1 else "tests"


def record_phase(name: str, start: float, seconds: float, status: int) -> None:
    """Add a step a fixture ran (an image imported into the node, a build) to $DISAGG_PHASES, the file of
    hack/test/phase.sh, when set: the report lists it with the build's steps."""
    target = os.environ.get("DISAGG_PHASES")
    if target:
        with open(target, "a") as f:
            f.write(f"{name}\t{int(start)}\t{seconds:.1f}\t{status}\n")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _CURRENT[nodeid] = time.time()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = _TIERS.setdefault(tier_of(report.fspath), Tier())
    now = time.time()
    started = _CURRENT.get(report.nodeid, now)
    tier.first = tier.first or started
    tier.last = max(tier.last, now)
    tier.seconds[report.nodeid] = tier.seconds.get(report.nodeid, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        tier.tests += 1
        tier.outcomes[report.outcome] = tier.outcomes.get(report.outcome, 0) + 1


def summary() -> dict[str, dict]:
    """Each tier's wall time, counts and slowest tests, in the order the tiers ran."""
    out = {}
    for name, tier in sorted(_TIERS.items(), key=lambda kv: kv[1].first):
        slowest = sorted(tier.seconds.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST]
        out[name] = {
            "wall_s": round(tier.last - tier.first, 1),
            "test_s": round(sum(tier.seconds.values()), 1),  # above wall_s where tests ran side by side
            "tests": tier.tests,
            "outcomes": tier.outcomes,
            "slowest": [{"test": test, "seconds": round(s, 1)} for test, s in slowest],
        }
    return out


def render(tiers: dict[str, dict]) -> list[str]:
    """The tier report as lines of text (also hack/test/report.py's)."""
    lines = []
    for name, tier in tiers.items():
        counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(tier["outcomes"].items()))
        wall = tier["wall_s"]
        busy = tier.get("test_s", wall)
        lines.append(
            f"{name}: {_clock(wall)} wall, {_clock(busy)} of tests' own time, {tier['tests']} tests ({counts})"
        )
        lines.extend(f"  {t['seconds']:7.1f} s  {t['test']}" for t in tier["slowest"])
    return lines


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tiers = summary()
    if not tiers:
        return
    terminalreporter.section("time by tier (slowest tests: set-up + call + teardown)")
    for line in render(tiers):
        terminalreporter.write_line(line)
    target = os.environ.get("DISAGG_TIER_REPORT")
    if target:
        merge_into(Path(target), tiers)


def merge_into(path: Path, tiers: dict[str, dict]) -> None:
    """Add these tiers to the report file, keeping what the run's other sessions wrote (`make test` runs three,
    two of them side by side): the read and the write happen under a lock on the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        earlier = json.loads(text) if text.strip() else {}
        f.seek(0)
        f.truncate()
        f.write(json.dumps({**earlier, **tiers}, indent=1))
