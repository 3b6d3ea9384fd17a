"""The router's pair verifier and handoff monitor, with workers as plain objects and a hand-moved clock."""

from __future__ import annotations

from disagg_worker.router.handoff import HandoffMonitor
from disagg_worker.router.policies import Policy
from disagg_worker.router.verify import PairVerifier, stable
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker(url: str, role: str, revision: str = "r1", pod: str = "") -> Worker:
    w = Worker(url, role, 8998 if role == "prefill" else 0, healthy=True)
    w.report = {"pod": pod or url, "revision": revision}
    return w


def setup(*workers: Worker, **kw) -> tuple[PairVerifier, Clock]:
    clock = Clock()
    pool = WorkerPool(static=list(workers), policy=Policy.ROUND_ROBIN)
    return PairVerifier(pool, interval_s=10, backoff_s=1, backoff_max_s=8, clock=clock, **kw), clock


def test_only_same_revision_pairs_exist_and_none_is_used_before_it_is_verified():
    p1, p2 = worker("http://p1", "prefill", "r1"), worker("http://p2", "prefill", "r2")
    d1, d2 = worker("http://d1", "decode", "r1"), worker("http://d2", "decode", "r2")
    v, _ = setup(p1, p2, d1, d2)
    assert set(v.refresh()) == {(p1, d1), (p2, d2)}
    assert not v.ready() and v.pick_pair() is None
    v._record((p1, d1), "")
    assert v.ready() and v.pick_pair() == (p1, d1)
    assert all(v.pick_pair() == (p1, d1) for _ in range(5))  # p2/d2 are unverified, p1/d2 never pair


def test_picks_spread_over_verified_pairs_and_respect_exclusions():
    p1, p2, d1, d2 = (
        worker(u, r)
        for u, r in [
            ("http://p1", "prefill"),
            ("http://p2", "prefill"),
            ("http://d1", "decode"),
            ("http://d2", "decode"),
        ]
    )
    v, _ = setup(p1, p2, d1, d2)
    v.refresh()
    for pair in [(p1, d1), (p2, d1), (p1, d2)]:  # (p2, d2) failed
        v._record(pair, "")
    v._record((p2, d2), "decode HTTP 503")
    picks = {v.pick_pair() for _ in range(12)}
    assert (p2, d2) not in picks and len(picks) >= 2
    assert v.pick_pair(exclude={d1}) == (p1, d2)
    assert v.pick_pair(exclude={d1, p1}) is None


def test_a_failed_pair_is_retried_with_a_doubling_backoff_and_a_verified_one_every_interval():
    p, d = worker("http://p", "prefill"), worker("http://d", "decode")
    v, clock = setup(p, d)
    assert v.refresh() == [(p, d)]
    due = []
    for _ in range(5):
        v._record((p, d), "prefill gave no answer within 60s")
        due.append(v.states[(p, d)].due - clock.now)
        clock.now = v.states[(p, d)].due
        assert v.refresh() == [(p, d)]
    assert due == [1, 2, 4, 8, 8]
    v._record((p, d), "")
    assert v.states[(p, d)].due - clock.now == 10 and v.refresh() == []


def test_a_worker_failing_its_health_check_fails_its_pairs_until_verified_again():
    p, d1, d2 = (
        worker("http://p", "prefill"),
        worker("http://d1", "decode", pod="m-decode-1"),
        worker("http://d2", "decode"),
    )
    v, clock = setup(p, d1, d2)
    v.refresh()
    v._record((p, d1), "")
    v._record((p, d2), "")
    d1.healthy = False
    v.refresh()
    listed = {x["decode"]: x for x in v.describe()}
    assert listed["m-decode-1"]["verified"] is False
    assert listed["m-decode-1"]["error"] == "decode m-decode-1 fails its health check"
    assert v.ready() and all(v.pick_pair() == (p, d2) for _ in range(4))
    d2.healthy = False
    v.refresh()
    assert not v.ready()
    d1.healthy = True
    assert (p, d1) in v.refresh()  # due at once, but not usable until a probe passes
    assert not v.ready()


def test_a_user_request_that_went_through_counts_as_a_verification():
    p, d = worker("http://p", "prefill"), worker("http://d", "decode")
    v, clock = setup(p, d)
    v.refresh()
    v.passed(p, d)
    clock.now = 9
    assert v.ready() and v.refresh() == []
    assert v.describe()[0]["age_s"] == 9


def test_at_most_max_probes_run_at_once():
    workers = [worker(f"http://p{i}", "prefill") for i in range(3)] + [
        worker(f"http://d{i}", "decode") for i in range(3)
    ]
    v, _ = setup(*workers, max_probes=2)
    due = v.refresh()
    assert len(due) == 2
    for pair in due:
        v.states[pair].probing = True
    assert v.refresh() == []


def test_error_messages_do_not_change_from_one_request_to_the_next():
    a = stable("decode HTTP 500: room 7340032112345 failed: no KV from prefill within 8s")
    b = stable("decode HTTP 500: room 912381237123 failed: no KV from prefill within 8s")
    assert a == b == "decode HTTP 500: room N failed: no KV from prefill within 8s"


def reporting(w: Worker, bf: int, tf: int, transfers: int, queues: dict[str, int]) -> None:
    w.report = {
        "pod": w.url,
        "revision": "r1",
        "queues": queues,
        "transfer": {"bootstrap_failures": bf, "transfer_failures": tf, "transfers": transfers},
    }


def test_failures_are_counted_over_the_window_and_a_restart_starts_over():
    clock = Clock()
    m = HandoffMonitor(window_s=100, stall_after_s=30, clock=clock)
    d = worker("http://d", "decode")
    reporting(d, 5, 1, 50, {})  # failures from before the router watched do not count
    m.observe([d])
    clock.now = 10
    reporting(d, 7, 1, 60, {})
    m.observe([d])
    assert m.describe()["workers"][0] == {
        "pod": "http://d",
        "role": "decode",
        "url": "http://d",
        "bootstrap_failures": 2,
        "transfer_failures": 0,
        "queued": 0,
        "stalled_queues": [],
    }
    clock.now = 111
    m.observe([d])
    assert m.describe()["workers"][0]["bootstrap_failures"] == 0  # left the window
    reporting(d, 1, 0, 3, {})  # restarted
    m.observe([d])
    clock.now = 112
    reporting(d, 2, 0, 3, {})
    m.observe([d])
    assert m.describe()["workers"][0]["bootstrap_failures"] == 1


def test_a_queue_that_holds_requests_without_progress_is_stalled_and_names_the_queue():
    clock = Clock()
    m = HandoffMonitor(window_s=100, stall_after_s=30, clock=clock)
    d = worker("http://d", "decode")
    reporting(d, 0, 0, 10, {"decode_transfer": 2, "decode_prealloc": 0, "decode_quarantine": 4})
    m.observe([d])
    clock.now = 29
    m.observe([d])
    assert m.describe()["workers"][0]["stalled_queues"] == []
    clock.now = 31
    m.observe([d])
    assert m.describe()["workers"][0]["stalled_queues"] == ["decode_transfer"]
    reporting(d, 0, 0, 11, {"decode_transfer": 2})  # one transfer finished: progress
    m.observe([d])
    assert m.describe()["workers"][0]["stalled_queues"] == []
    reporting(d, 0, 0, 11, {"decode_transfer": 0})
    clock.now = 100
    m.observe([d])
    assert m.describe()["workers"][0]["stalled_queues"] == []  # nothing waits: nothing is stalled
    m.observe([])
    assert m.describe()["workers"] == []
