"""What status.planner says, when it is written, the PlannerRecommendation Event, Apply's writes and the HPA
check: pure functions over the planner's decisions."""

import pytest

from disagg_operator.planner import plan
from disagg_operator.planner.capacity import CapacityModel, StepModel
from disagg_operator.planner.from_cr import capacity_model, planner_spec
from disagg_operator.planner.inputs import Mode, Observations, PlannerSpec, Replicas, RoleLimits, Slo
from disagg_operator.planner_loop import hpa_owned
from disagg_operator.planner_report import next_status, planner_content, recommendation_event, scale_writes

MODEL = CapacityModel(StepModel(20, 0.1), StepModel(10, 0, 1e-4), max_prefill_tokens=8192, decode_kv_tokens=200_000)
LOAD = Observations(arrival_rate=10, uncached_prompt_tokens=2000, prompt_tokens=2000, output_tokens=500)
SPEC = PlannerSpec(Slo(500, 50), Mode.ADVISORY, RoleLimits(1, 16), RoleLimits(1, 16))
NOW = "2026-01-01T00:00:00Z"


def test_the_status_says_desired_and_current_the_reason_and_the_estimates():
    d = plan(LOAD, MODEL, SPEC, Replicas(1, 1))
    content = planner_content(Mode.ADVISORY, d, Replicas(1, 1), "measured on 1 prefill and 1 decode pods", ())
    assert content["mode"] == "Advisory"
    assert content["desired"] == {"prefill": 3, "decode": 4} and content["current"] == {"prefill": 1, "decode": 1}
    assert content["reason"].startswith("measured on 1 prefill and 1 decode pods; ")
    assert "20000 uncached tok/s over 9200 tok/s" in content["reason"]
    assert content["estimatedTtftMs"] == 280 and content["estimatedItlMs"] == 14  # whole milliseconds
    assert content["unreachable"] == [] and content["advisoryRoles"] == []


def test_an_unreachable_target_is_named_and_an_infinite_estimate_left_out():
    d = plan(LOAD, MODEL, PlannerSpec(Slo(30, 5), Mode.ADVISORY, RoleLimits(1, 2), RoleLimits(1, 2)), Replicas(1, 1))
    content = planner_content(Mode.ADVISORY, d, Replicas(1, 1), "", ())
    assert content["unreachable"] == ["prefill", "decode"]
    assert content["estimatedTtftMs"] is None  # two prefills cannot keep up at all


def test_missing_observations_hold_the_current_replicas_and_say_why():
    d = plan(None, MODEL, SPEC, Replicas(2, 3))
    content = planner_content(Mode.ADVISORY, d, Replicas(2, 3), "2 of 2 worker pods did not answer /metrics", ())
    assert content["desired"] == {"prefill": 2, "decode": 3}
    assert content["reason"] == (
        "2 of 2 worker pods did not answer /metrics; observations missing: holding the current replicas"
    )


def test_a_status_is_written_only_when_what_it_says_changes_never_for_the_time_alone():
    held = plan(None, MODEL, SPEC, Replicas(1, 1))  # no estimates: fields the merge patch removes
    content = planner_content(Mode.ADVISORY, held, Replicas(1, 1), "", ())
    first = next_status(None, content, NOW)
    assert first is not None and first["lastDecisionTime"] == NOW
    # As the API server gives it back: without the fields the merge patch removed.
    stored = {k: v for k, v in first.items() if v is not None}
    assert next_status(stored, content, "2026-01-01T00:10:00Z") is None
    assert next_status(first, content, "2026-01-01T00:10:00Z") is None  # as the operator remembers it
    moved = {**content, "reason": "other"}
    assert next_status(stored, moved, "2026-01-01T00:10:00Z")["lastDecisionTime"] == "2026-01-01T00:10:00Z"


def test_one_event_per_changed_recommendation():
    content = planner_content(Mode.ADVISORY, plan(LOAD, MODEL, SPEC, Replicas(1, 1)), Replicas(1, 1), "", ())
    event = recommendation_event(None, content)
    assert event is not None and event.reason == "PlannerRecommendation" and event.type == "Normal"
    assert event.message.startswith("Advisory: prefill 3, decode 4: ")
    assert recommendation_event(content, {**content, "reason": "other words"}) is None
    again = recommendation_event(content, {**content, "desired": {"prefill": 2, "decode": 4}})
    assert again is not None and "prefill 2, decode 4 (was prefill 3, decode 4)" in again.message


@pytest.mark.parametrize(
    "advisory, ratio, expected",
    [((), False, {"prefill": 3, "decode": 4}), (("decode",), False, {"prefill": 3}), ((), True, {"decode": 4})],
)
def test_apply_writes_the_changed_roles_no_hpa_owns_and_prefill_only_when_it_is_its_own(advisory, ratio, expected):
    assert scale_writes(Replicas(3, 4), Replicas(1, 1), advisory, ratio) == expected
    assert scale_writes(Replicas(1, 4), Replicas(1, 4), (), False) == {}
    assert scale_writes(None, Replicas(1, 1), (), False) == {}


def test_an_hpa_on_a_scale_subresource_makes_that_role_advisory():
    def hpa(kind: str, name: str) -> dict:
        return {"spec": {"scaleTargetRef": {"apiVersion": "disagg.dev/v1alpha1", "kind": kind, "name": name}}}

    assert hpa_owned([hpa("DisaggregatedModel", "tiny")], "tiny", "tiny-prefill") == ("decode",)
    assert hpa_owned(
        [hpa("RoleScaler", "tiny-prefill"), hpa("DisaggregatedModel", "other")], "tiny", "tiny-prefill"
    ) == ("prefill",)
    assert hpa_owned([hpa("Deployment", "tiny")], "tiny", "tiny-prefill") == ()


def test_the_profile_is_the_capacity_model_and_without_one_there_is_none():
    planner = {
        "mode": "Advisory",
        "profile": {"prefillBaseMs": 20, "prefillMsPerToken": 0.1, "decodeBaseMs": 10, "decodeMsPerKvToken": 1e-4},
    }
    spec = {"scaling": {"slo": {"ttftMs": 500, "itlMs": 50}, "planner": planner}}
    assert capacity_model(spec) == CapacityModel(StepModel(20, 0.1), StepModel(10, 0, 1e-4))
    assert capacity_model({"scaling": {"slo": {"ttftMs": 500, "itlMs": 50}, "planner": {}}}) is None
    assert planner_spec(spec) is not None and planner_spec({}) is None
