"""PairingVerified, HandoffStalled and status.transfer from what the router pods report (or fail to)."""

from disagg_operator.observe import RoleObservation
from disagg_operator.routerview import (
    PairResult,
    RouterView,
    handoff_condition,
    merge_reports,
    pairing_condition,
    transfer_status,
)
from disagg_operator.spec import ModelSpec

SPEC = ModelSpec.from_cr(
    {
        "metadata": {"name": "m", "namespace": "ns", "uid": "u"},
        "spec": {"model": {"hostPath": "/m", "path": "x"}, "image": "img", "router": {"replicas": 2}},
    }
)


def pair(p: str, d: str, ok: bool, error: str = "") -> dict:
    return {"prefill": p, "decode": d, "verified": ok, "error": error, "age_s": 3.2, "revision": "r1"}


def handoff(*workers: dict) -> dict:
    return {"window_s": 300, "stall_after_s": 60, "workers": list(workers)}


def worker(pod: str, role: str, bf: int = 0, tf: int = 0, stalled: tuple[str, ...] = ()) -> dict:
    return {
        "pod": pod,
        "role": role,
        "bootstrap_failures": bf,
        "transfer_failures": tf,
        "stalled_queues": list(stalled),
    }


def test_without_any_answer_pairing_follows_router_readiness_and_says_details_are_missing():
    unreachable = merge_reports({"m-router-a": None, "m-router-b": None})
    assert unreachable.reached == 0 and unreachable.probed == 2
    ready = pairing_condition(SPEC, RoleObservation(2, 2, 2), unreachable)
    assert ready[:2] == ("True", "RouterReady") and "cannot read the router pods' /health" in ready[2]
    waiting = pairing_condition(SPEC, RoleObservation(2, 1, 2), None)
    assert waiting[:2] == ("Unknown", "RouterNotReady") and "ready 1/2" in waiting[2]
    assert handoff_condition(unreachable)[:2] == ("Unknown", "NotObserved")
    assert transfer_status(unreachable) is None


def test_failing_pairs_are_named_and_a_router_without_a_verified_pair_makes_it_false():
    some = merge_reports(
        {
            "m-router-a": {"pairs": [pair("p0", "d0", True), pair("p0", "d1", False, "decode HTTP 503: draining")]},
            "m-router-b": {"pairs": [pair("p0", "d0", True), pair("p0", "d1", True)]},
        }
    )
    status, reason, message = pairing_condition(SPEC, RoleObservation(2, 2, 2), some)
    assert (status, reason) == ("True", "SomePairsFailing")
    assert message == "1 of 2 pairs verified; out of rotation: p0 -> d1: decode HTTP 503: draining"
    none = merge_reports({"m-router-a": {"pairs": [pair("p0", "d0", False, "prefill gave no answer within 60s")]}})
    status, reason, message = pairing_condition(SPEC, RoleObservation(2, 2, 2), none)
    assert (status, reason) == ("False", "NoVerifiedPair")
    assert "m-router-a has no verified pair" in message and "p0 -> d0: prefill gave no answer within 60s" in message
    everyone = merge_reports({"m-router-a": {"pairs": [pair("p0", "d0", True)]}})
    assert pairing_condition(SPEC, None, everyone) == ("True", "PairsVerified", "all 1 prefill->decode pairs verified")
    empty = merge_reports({"m-router-a": {"pairs": []}})
    assert pairing_condition(SPEC, None, empty)[:2] == ("Unknown", "WaitingForWorkers")


def test_no_router_means_nothing_is_verified():
    spec = ModelSpec.from_cr(
        {
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"model": {"hostPath": "/m", "path": "x"}, "image": "i", "router": {"replicas": 0}},
        }
    )
    assert pairing_condition(spec, None, None)[:2] == ("False", "NoRouter")


def test_transfer_counts_sum_per_role_taking_each_pods_largest_report():
    view = merge_reports(
        {
            "r-a": {"handoff": handoff(worker("p0", "prefill", bf=2), worker("d0", "decode", tf=1))},
            "r-b": {"handoff": handoff(worker("p0", "prefill", bf=3), worker("d1", "decode", tf=4))},
        }
    )
    assert transfer_status(view) == {
        "windowSeconds": 300,
        "prefill": {"bootstrapFailures": 3, "transferFailures": 0},
        "decode": {"bootstrapFailures": 0, "transferFailures": 5},
        "failingPods": ["d0", "d1", "p0"],
    }
    assert handoff_condition(view)[:2] == ("False", "Flowing")


def test_a_stalled_queue_names_its_pod_in_a_message_that_does_not_tick():
    view = merge_reports({"r-a": {"handoff": handoff(worker("d1", "decode", stalled=("decode_transfer",)))}})
    assert handoff_condition(view) == (
        "True",
        "QueueStalled",
        "decode pod d1: decode_transfer hold requests without handoff progress for over 60 s",
    )


def test_long_lists_are_cut():
    view = RouterView(1, 1, ("r",), tuple(PairResult(f"p{i}", "d", False, "x") for i in range(8)))
    assert pairing_condition(SPEC, None, view)[2].endswith("p4 -> d: x and 3 more")


def test_a_router_that_misses_one_probe_does_not_flip_the_status_to_readiness_only():
    from disagg_operator.prober import MISSES_BEFORE_FORGETTING, keep_or_replace

    seen = merge_reports({"r": {"pairs": [pair("p0", "d0", True)]}})
    silent = merge_reports({"r": None})
    misses: dict[str, int] = {}
    view = seen
    for _ in range(MISSES_BEFORE_FORGETTING - 1):
        view = keep_or_replace(view, silent, misses, "u")
        assert view is seen
    assert keep_or_replace(view, silent, misses, "u") is silent
    assert keep_or_replace(silent, seen, misses, "u") is seen and misses == {}
    assert keep_or_replace(None, merge_reports({}), misses, "u") is None


def test_a_malformed_report_reads_field_by_field_as_absent_or_failed():
    good = {"pairs": [pair("p0", "d0", True)], "handoff": handoff(worker("d0", "decode", tf=2))}
    forged_truths = [{"verified": {"yes": 1}}, {"verified": "true"}, {"verified": 1}]
    bad = {
        "r-bad": {"pairs": "verified", "handoff": {"workers": 7, "window_s": "300"}},
        "r-types": {
            "pairs": [*({"prefill": "p0", "decode": "d0", **v} for v in forged_truths), 3, None],
            "handoff": {"window_s": {}, "workers": [{"pod": ["d0"], "bootstrap_failures": "9"}, "x"]},
        },
        "r-handoff": {"pairs": [pair("p0", "d0", True)], "handoff": "stalled"},
        "r-list": ["not", "an", "object"],
    }
    view = merge_reports({"r-good": good, **bad})  # type: ignore[dict-item]
    assert view.probed == 5 and view.reached == 4  # a list is no report
    assert view.without_pair == ("r-bad", "r-types")  # a verified field that is not JSON true verifies nothing
    # Entries that are not objects are skipped; r-types' failed p0 -> d0 is the worst result, as any failure is.
    assert [(p.prefill, p.decode, p.verified) for p in view.pairs] == [("p0", "d0", False)]
    assert {(w.pod, w.bootstrap_failures, w.transfer_failures) for w in view.workers} == {("d0", 0, 2), ("?", 0, 0)}
    assert view.window_s == 300
    assert merge_reports({"r-good": good}).pairs == (PairResult("p0", "d0", True, "", "r1"),)


def test_one_models_reports_failing_to_merge_leave_the_others_views_current():
    from disagg_operator.config import OperatorConfig
    from disagg_operator.prober import take_reports
    from disagg_operator.reconcile import Runtime

    rt = Runtime(None, OperatorConfig(), lambda cr, e: None)  # type: ignore[arg-type]
    first, second = rt.model("u1"), rt.model("u2")
    reports = {"u1": 5, "u2": {"r": {"pairs": [pair("p0", "d0", True)]}}}  # u1's is not even a mapping of pods
    take_reports(rt, reports, {})  # type: ignore[arg-type]
    assert first.view is None and second.view is not None and second.view.pairs[0].verified
