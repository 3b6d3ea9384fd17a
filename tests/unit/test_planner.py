"""The SLO planner's decisions on worked examples whose numbers can be checked by hand.

The model throughout: a prefill step costs 20 ms plus 0.1 ms per prompt token (10k tok/s at most); a decode step
10 ms plus 0.1 ms per 1000 KV tokens attended; a decode pool holds 200k tokens. Targets: TTFT 500 ms, ITL 50 ms.
Load: 10 requests/s, 2000-token prompts (none cached), 500-token answers.
"""

import math

import pytest

from disagg_operator.planner import plan
from disagg_operator.planner.capacity import CapacityModel, StepModel, estimated_ttft_ms
from disagg_operator.planner.constraints import Recommendation
from disagg_operator.planner.from_cr import planner_spec
from disagg_operator.planner.inputs import Mode, Observations, PlannerSpec, Replicas, RoleLimits, Slo

MODEL = CapacityModel(StepModel(20, 0.1), StepModel(10, 0, 1e-4), max_prefill_tokens=8192, decode_kv_tokens=200_000)
LOAD = Observations(arrival_rate=10, uncached_prompt_tokens=2000, prompt_tokens=2000, output_tokens=500)
WIDE = RoleLimits(min=1, max=16)


def spec(**kw) -> PlannerSpec:
    base = {"slo": Slo(500, 50), "mode": Mode.APPLY, "prefill": WIDE, "decode": WIDE}
    return PlannerSpec(**{**base, **kw})


def load(**kw) -> Observations:
    return Observations(**{**LOAD.__dict__, **kw})


def test_prefill_by_uncached_tokens_and_decode_by_the_larger_of_itl_and_kv():
    # Prefill: half the TTFT budget is a 250 ms step = (250 - 20) / 0.1 = 2300 tokens, 9200 tok/s; the load is
    # 10 x 2000 = 20000 tok/s -> ceil(2.17) = 3. Decode: a 50 ms step attends to (50 - 10) / 1e-4 = 400k tokens,
    # i.e. 400k / 2250 (prompt + half the answer) = 177.8 requests at 20 tok/s each = 3556 tok/s; 5000 tok/s ->
    # 2 by ITL. Concurrency at ITL 50 ms is 5000 x 0.05 = 250 requests of up to 2500 tokens = 625k tokens over
    # 200k a pool -> 4 by KV. Decode takes the larger: 4.
    d = plan(LOAD, MODEL, spec(), Replicas(1, 1))
    assert d.desired == Replicas(3, 4)
    assert d.writes == Replicas(3, 4)
    assert "20000 uncached tok/s over 9200 tok/s" in d.reason
    assert "5000 tok/s over 3556 tok/s per decode within ITL -> 2" in d.reason
    assert "KV for 250 concurrent requests -> 4" in d.reason
    # At 3 prefills each keeps up with 6667 tok/s in 400-token steps of 60 ms; a prompt waits one (60 ms) and
    # is computed in 20 + 200 = 220 ms: 280 ms. ITL at 4 decodes: 10 / (1 - 1e-4 x 5000 x 2250 / 4000) = 13.9 ms.
    assert d.estimated_ttft_ms == pytest.approx(280)
    assert d.estimated_itl_ms == pytest.approx(10 / (1 - 0.28125))
    assert d.infeasible == ()


def test_a_larger_pool_leaves_decode_bound_by_itl():
    d = plan(LOAD, CapacityModel(MODEL.prefill, MODEL.decode, decode_kv_tokens=10_000_000), spec(), Replicas(1, 1))
    assert d.desired == Replicas(3, 2)


def test_a_prefix_cache_shrinks_prefill_but_not_decode():
    # 500 uncached tokens a request: 5000 tok/s fits one prefill (9200); decode still holds the whole prompt.
    d = plan(load(uncached_prompt_tokens=500), MODEL, spec(), Replicas(1, 1))
    assert d.desired == Replicas(1, 4)


def test_queued_tokens_of_closed_loop_clients_are_not_demand():
    calm = plan(LOAD, MODEL, spec(), Replicas(3, 4))
    queued = plan(load(queued_prefill_tokens=64 * 2000 * 10), MODEL, spec(), Replicas(3, 4))
    assert queued.desired == calm.desired == Replicas(3, 4)


def test_an_unreachable_ttft_is_reported_and_sized_by_throughput_not_sent_to_the_maximum():
    # 30 ms: half is 15 ms, under an empty step's 20 ms. At full 8192-token chunks a prefill computes
    # 8192 / 839.2 ms = 9762 tok/s -> ceil(20000 / 9762) = 3, not 16; a measured 900 ms adds nothing.
    d = plan(load(ttft_ms=900), MODEL, spec(slo=Slo(30, 50)), Replicas(3, 4))
    assert d.desired == Replicas(3, 4)
    assert d.infeasible == ("prefill",)
    assert "TTFT 30 ms cannot be met" in d.reason


def test_an_unreachable_itl_is_reported_and_decode_sized_by_its_kv():
    d = plan(LOAD, MODEL, spec(slo=Slo(500, 8)), Replicas(1, 1))
    assert d.infeasible == ("decode",)
    assert "ITL 8 ms cannot be met" in d.reason
    # Concurrency at 8 ms: 5000 x 0.008 = 40 requests x 2500 tokens = 100k tokens: one pool.
    assert d.desired.decode == 1


@pytest.mark.parametrize(
    "ttft,itl,expected",
    [
        (620, 55, Replicas(4, 5)),  # both over their targets: one more than now each
        (300, 30, Replicas(3, 4)),  # within the band: the model's counts
        (200, 20, Replicas(2, 3)),  # under half the targets while the model asks for the current: one fewer
    ],
)
def test_the_fast_correction_moves_one_replica_on_the_measured_latency(ttft, itl, expected):
    d = plan(load(ttft_ms=ttft, itl_ms=itl), MODEL, spec(scale_down_stabilization_s=0), Replicas(3, 4))
    assert d.desired == expected


def test_the_stabilisation_window_holds_a_scale_down_until_the_peak_leaves_it():
    s = spec(scale_down_stabilization_s=300)
    peak = plan(LOAD, MODEL, s, Replicas(3, 4), now_s=0)
    quiet = load(arrival_rate=1)  # 2000 tok/s and 500 tok/s: one of each
    held = plan(quiet, MODEL, s, peak.desired, history=peak.history, now_s=60)
    assert held.desired == Replicas(3, 4)
    assert "held by the scale-down stabilisation window" in held.reason
    later = plan(quiet, MODEL, s, held.desired, history=held.history, now_s=301)
    assert later.desired == Replicas(1, 1)


def test_the_window_keeps_the_highest_recommendation_of_its_span_as_kubernetes_hpa_does():
    history = (Recommendation(0, Replicas(2, 3)), Recommendation(100, Replicas(1, 2)))
    d = plan(load(arrival_rate=1), MODEL, spec(), Replicas(3, 4), history=history, now_s=200)
    assert d.desired == Replicas(2, 3)


def test_the_step_limit_bounds_one_change():
    assert plan(LOAD, MODEL, spec(max_step=2), Replicas(1, 1)).desired == Replicas(3, 3)


@pytest.mark.parametrize("budget,expected", [(7, Replicas(3, 4)), (5, Replicas(1, 4)), (4, Replicas(1, 3))])
def test_the_gpu_budget_serves_decode_first(budget, expected):
    one_gpu = RoleLimits(min=1, max=16, gpus=1)
    d = plan(LOAD, MODEL, spec(prefill=one_gpu, decode=one_gpu, gpu_budget=budget), Replicas(1, 1))
    assert d.desired == expected
    assert d.desired.gpus(spec(prefill=one_gpu, decode=one_gpu)) <= budget


def test_nothing_shrinks_during_a_rollout_but_it_may_grow():
    s = spec(scale_down_stabilization_s=0)
    assert plan(load(arrival_rate=1), MODEL, s, Replicas(3, 4), rolling=True).desired == Replicas(3, 4)
    # Twice the load: 40000 / 9200 -> 5 prefills; 500 concurrent x 2500 tokens / 200k -> 7 decodes.
    assert plan(load(arrival_rate=20), MODEL, s, Replicas(3, 4), rolling=True).desired == Replicas(5, 7)


def test_prefill_per_decode_sizes_decode_for_both_roles_and_keeps_the_ratio():
    # Prefill needs 3; at 0.5 prefill per decode that is 6 decodes, more than decode's own 4.
    d = plan(LOAD, MODEL, spec(prefill_per_decode=0.5), Replicas(2, 4))
    assert d.desired == Replicas(3, 6)
    # The step limit (4) bounds decode, and prefill follows it: 5 decodes -> ceil(2.5) = 3 prefills.
    assert plan(LOAD, MODEL, spec(prefill_per_decode=0.5), Replicas(1, 1)).desired == Replicas(3, 5)


@pytest.mark.parametrize(
    "mode,writes", [(Mode.OFF, None), (Mode.ADVISORY, None), (Mode.APPLY, Replicas(3, 4))], ids=str
)
def test_off_decides_nothing_advisory_writes_nothing_apply_writes(mode, writes):
    d = plan(LOAD, MODEL, spec(mode=mode), Replicas(1, 1))
    assert d.writes == writes
    assert d.desired == (Replicas(1, 1) if mode is Mode.OFF else Replicas(3, 4))


def test_apply_writes_nothing_when_nothing_changes():
    assert plan(LOAD, MODEL, spec(), Replicas(3, 4)).writes is None


def test_missing_observations_or_model_freeze_the_planner_and_say_so():
    missing = plan(None, MODEL, spec(), Replicas(2, 2))
    assert (missing.desired, missing.writes) == (Replicas(2, 2), None)
    assert "observations missing" in missing.reason
    assert "no capacity model yet" in plan(LOAD, None, spec(), Replicas(2, 2)).reason


def test_the_ttft_estimate_is_infinite_where_the_replicas_cannot_keep_up():
    assert math.isinf(estimated_ttft_ms(MODEL, 20000, 2000, 1))  # over one prefill's 10k tok/s
    assert estimated_ttft_ms(MODEL, 0, 2000, 1) == pytest.approx(220)  # idle: the prompt alone


def test_a_crs_scaling_block_reads_as_the_planners_spec_with_the_schemas_defaults():
    cr_spec = {
        "prefill": {"resources": {"gpus": 2}},
        "decode": {"resources": {"gpus": 1}},
        "scaling": {
            "slo": {"ttftMs": 500, "itlMs": 50},
            "planner": {"mode": "Apply", "gpuBudget": 12, "decode": {"maxReplicas": 6}},
        },
    }
    assert planner_spec(cr_spec) == PlannerSpec(
        slo=Slo(500, 50, 90),
        mode=Mode.APPLY,
        prefill=RoleLimits(1, 8, 2),
        decode=RoleLimits(1, 6, 1),
        gpu_budget=12,
        max_step=4,
        scale_down_stabilization_s=300,
    )
    ratio = {
        "scaling": {
            "slo": {"ttftMs": 1, "itlMs": 1},
            "prefillPerDecode": 0.5,
            "planner": {"relation": "PrefillPerDecode"},
        }
    }
    assert planner_spec(ratio).prefill_per_decode == 0.5
    assert planner_spec({"scaling": {"slo": {"ttftMs": 1, "itlMs": 1}, "planner": {"mode": "Off"}}}) is None
    assert planner_spec({"scaling": {}}) is None
