"""What the planner's decision always keeps, whatever the model, the load and the limits."""

from dataclasses import replace

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from disagg_operator.planner import plan
from disagg_operator.planner.capacity import CapacityModel, StepModel
from disagg_operator.planner.constraints import Recommendation
from disagg_operator.planner.inputs import Mode, Observations, PlannerSpec, Replicas, RoleLimits, Slo

FAST = settings(max_examples=100, deadline=None)

models = st.builds(
    CapacityModel,
    prefill=st.builds(StepModel, st.floats(1, 200), st.floats(0, 1), st.just(0.0)),
    decode=st.builds(StepModel, st.floats(1, 60), st.just(0.0), st.floats(0, 1e-3)),
    max_prefill_tokens=st.integers(256, 16384),
    decode_kv_tokens=st.integers(10_000, 2_000_000),
)
latency = st.none() | st.floats(1, 5000)
loads = st.builds(
    Observations,
    arrival_rate=st.floats(0, 200),
    uncached_prompt_tokens=st.floats(0, 8000),
    prompt_tokens=st.floats(0, 16000),
    output_tokens=st.floats(1, 4000),
    queued_prefill_tokens=st.floats(0, 1e6),
    ttft_ms=latency,
    itl_ms=latency,
)


@st.composite
def limits(draw) -> RoleLimits:
    low = draw(st.integers(0, 4))
    return RoleLimits(low, draw(st.integers(max(low, 1), 32)), draw(st.integers(0, 8)))


@st.composite
def specs(draw, budget: bool = True, ratio: bool | None = None) -> PlannerSpec:
    """`ratio`: None draws either relation, True always prefillPerDecode, False always independent."""
    prefill, decode = draw(limits()), draw(limits())
    least = prefill.min * prefill.gpus + decode.min * decode.gpus
    return PlannerSpec(
        slo=Slo(draw(st.floats(20, 5000)), draw(st.floats(5, 200))),
        mode=draw(st.sampled_from([Mode.ADVISORY, Mode.APPLY])),
        prefill=prefill,
        decode=decode,
        gpu_budget=draw(st.none() | st.integers(least, least + 64)) if budget else None,
        prefill_per_decode=None if ratio is False else draw((st.nothing() if ratio else st.none()) | st.floats(0.1, 4)),
        max_step=draw(st.integers(1, 8)),
        scale_down_stabilization_s=draw(st.floats(0, 900)),
    )


@st.composite
def currents(draw, spec: PlannerSpec) -> Replicas:
    """Replicas within the spec's limits and budget, as a running planner keeps them."""
    r = Replicas(
        draw(st.integers(spec.prefill.min, spec.prefill.max)), draw(st.integers(spec.decode.min, spec.decode.max))
    )
    assume(spec.gpu_budget is None or r.gpus(spec) <= spec.gpu_budget)
    return r


histories = st.lists(
    st.builds(Recommendation, st.floats(0, 1000), st.builds(Replicas, st.integers(0, 40), st.integers(0, 40))),
    max_size=4,
).map(tuple)


def independent(spec: PlannerSpec) -> bool:
    return spec.prefill_per_decode is None


@FAST
@given(data=st.data(), spec=specs(ratio=False), obs=loads, model=models, history=histories, rolling=st.booleans())
def test_never_beyond_the_maxima_or_the_budget_nor_below_the_minima(data, spec, obs, model, history, rolling):
    current = data.draw(currents(spec))
    d = plan(obs, model, spec, current, rolling, history, now_s=1000)
    for role in ("prefill", "decode"):
        assert spec.limits(role).min <= d.desired.of(role) <= spec.limits(role).max
    assert spec.gpu_budget is None or d.desired.gpus(spec) <= spec.gpu_budget


@FAST
@given(data=st.data(), spec=specs(ratio=True), obs=loads, model=models, history=histories)
def test_keeping_a_ratio_never_passes_decodes_bounds_or_the_budget(data, spec, obs, model, history):
    current = data.draw(currents(spec))
    d = plan(obs, model, spec, current, False, history, now_s=1000)
    assert spec.decode.min <= d.desired.decode <= spec.decode.max
    assert spec.gpu_budget is None or d.desired.gpus(spec) <= spec.gpu_budget or d.desired.decode == spec.decode.min


@FAST
@given(data=st.data(), spec=specs(), obs=loads, model=models, history=histories)
def test_nothing_shrinks_during_a_rollout(data, spec, obs, model, history):
    current = data.draw(currents(spec))
    d = plan(obs, model, spec, current, True, history, now_s=1000)
    assert d.desired.decode >= current.decode
    if independent(spec):
        assert d.desired.prefill >= current.prefill


@FAST
@given(data=st.data(), spec=specs(budget=False), obs=loads, model=models, history=histories, more=st.floats(1, 10))
def test_more_load_never_means_fewer_replicas(data, spec, obs, model, history, more):
    current = data.draw(currents(spec))
    busier = replace(obs, arrival_rate=obs.arrival_rate * more)
    low = plan(obs, model, spec, current, False, history, now_s=1000).desired
    high = plan(busier, model, spec, current, False, history, now_s=1000).desired
    assert high.prefill >= low.prefill and high.decode >= low.decode


@FAST
@given(data=st.data(), spec=specs(), obs=loads, model=models, more=st.floats(1, 10))
def test_under_a_budget_more_load_never_means_fewer_decodes(data, spec, obs, model, more):
    current = data.draw(currents(spec))
    low = plan(obs, model, spec, current).desired
    high = plan(replace(obs, arrival_rate=obs.arrival_rate * more), model, spec, current).desired
    assert high.decode >= low.decode


@FAST
@given(data=st.data(), spec=specs(budget=False), obs=loads, model=models, age=st.floats(0, 1))
def test_the_stabilisation_window_holds_a_scale_down(data, spec, obs, model, age):
    current = data.draw(currents(spec))
    assume(spec.scale_down_stabilization_s > 0 and age < 1)
    peak = Recommendation(0.0, current)
    d = plan(obs, model, spec, current, False, (peak,), now_s=age * spec.scale_down_stabilization_s)
    # The current replicas were recommended within the window: nothing goes under them.
    assert d.desired.decode >= current.decode
    if independent(spec):
        assert d.desired.prefill >= current.prefill


@FAST
@given(data=st.data(), spec=specs(), obs=loads, model=models, history=histories)
def test_off_changes_nothing_advisory_only_reports_apply_writes_what_it_decides(data, spec, obs, model, history):
    current = data.draw(currents(spec))
    off = plan(obs, model, replace(spec, mode=Mode.OFF), current, False, history, 1000)
    advisory = plan(obs, model, replace(spec, mode=Mode.ADVISORY), current, False, history, 1000)
    apply = plan(obs, model, replace(spec, mode=Mode.APPLY), current, False, history, 1000)
    assert (off.desired, off.writes) == (current, None)
    assert advisory.writes is None
    assert advisory.desired == apply.desired
    assert apply.writes == (apply.desired if apply.desired != current else None)


@FAST
@given(data=st.data(), spec=specs(), obs=loads, model=models, queued=st.floats(0, 1e7))
def test_queued_prefill_tokens_never_change_the_decision(data, spec, obs, model, queued):
    current = data.draw(currents(spec))
    assert plan(replace(obs, queued_prefill_tokens=queued), model, spec, current).desired == (
        plan(obs, model, spec, current).desired
    )
