"""The tier report of `make test`: sessions that end at once each keep their tiers in the one file."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from tests.phases import merge_into, render

ROUNDS = 300


def _write(path: str, name: str, go) -> None:
    go.wait(30)  # both writers start together, so that their merges interleave
    for i in range(ROUNDS):
        merge_into(Path(path), {f"{name}-{i}": {"wall_s": 1.0, "tests": 1, "outcomes": {"passed": 1}, "slowest": []}})


def test_sessions_merging_side_by_side_lose_no_tier(tmp_path):
    path = tmp_path / "build" / "tiers.json"
    ctx = multiprocessing.get_context("spawn")
    go = ctx.Event()
    procs = [ctx.Process(target=_write, args=(str(path), name, go)) for name in ("local", "cluster")]
    for p in procs:
        p.start()
    go.set()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    tiers = json.loads(path.read_text())
    assert sorted(tiers) == sorted(f"{name}-{i}" for name in ("local", "cluster") for i in range(ROUNDS))
    assert render({"local-0": tiers["local-0"]}) == ["local-0: 0:01 wall, 0:01 of tests' own time, 1 tests (1 passed)"]
