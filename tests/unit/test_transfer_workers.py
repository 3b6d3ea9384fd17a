"""TransferWorkers: jobs of one destination are polled oldest first, the walk stops at the first
job still waiting, and a full pass still finds a job that finished out of order."""

from __future__ import annotations

import threading
import time

from disagg_worker.disagg.mooncake.transfer_workers import Progress, TransferWorkers, poll_in_order
from disagg_worker.tuning import TUNING
from tests.timing import scaled


class Jobs:
    """Scripted jobs: each poll of job `name` answers the next state in its script (the last one repeats)."""

    def __init__(self, **scripts: list[Progress]):
        self.scripts = scripts
        self.polled: list[str] = []

    def progress(self, name: str) -> Progress:
        self.polled.append(name)
        script = self.scripts[name]
        return script.pop(0) if len(script) > 1 else script[0]


W, M, S = Progress.WAITING, Progress.MOVED, Progress.SETTLED


def test_the_walk_stops_at_the_first_waiting_job_and_keeps_the_rest_in_order():
    jobs = Jobs(a=[S], b=[M], c=[W], d=[S])
    assert poll_in_order(["a", "b", "c", "d"], jobs.progress, full=False) == ["b", "c", "d"]
    assert jobs.polled == ["a", "b", "c"]  # d may have finished, but is not looked at until c moves


def test_a_full_pass_polls_every_job_and_drops_the_settled_ones():
    jobs = Jobs(a=[W], b=[S], c=[W], d=[S])
    assert poll_in_order(["a", "b", "c", "d"], jobs.progress, full=True) == ["a", "c"]
    assert jobs.polled == ["a", "b", "c", "d"]


def test_a_job_that_finished_behind_a_stuck_one_is_settled_within_the_full_poll_interval():
    settled: dict[str, float] = {}
    polls = {"stuck": 0, "quick": 0}
    release = threading.Event()

    def progress(job: str) -> Progress:
        polls[job] += 1
        if (job == "stuck" and not release.is_set()) or (job == "quick" and polls[job] == 1):
            return W  # quick is still on the wire at its first poll, and finishes right after
        settled.setdefault(job, time.monotonic())
        return S

    workers: TransferWorkers[str] = TransferWorkers(lambda job: None, progress)
    try:
        t0 = time.monotonic()
        workers.put("peer", "stuck")
        workers.put("peer", "quick")
        deadline = t0 + scaled(2.0)
        while "quick" not in settled and time.monotonic() < deadline:
            time.sleep(0.001)
        assert "quick" in settled and "stuck" not in settled
        full_pass = TUNING.transfer.full_poll_interval_s  # 2 ms
        assert settled["quick"] - t0 < scaled(100 * full_pass)
        release.set()
        while "stuck" not in settled and time.monotonic() < deadline:
            time.sleep(0.001)
        assert "stuck" in settled
    finally:
        workers.close()
