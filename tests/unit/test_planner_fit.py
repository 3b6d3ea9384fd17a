"""The step-time model fitted from per-step records, seeded by a profile."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_operator.planner.capacity import StepModel
from disagg_operator.planner.fit import StepRecord, fit_step_model

PROFILE = StepModel(20, 0.1, 1e-4)


def test_no_records_give_the_profile_back():
    assert fit_step_model([], PROFILE) == pytest.approx(PROFILE)


def test_records_of_a_mixed_worker_recover_its_three_numbers():
    # 12 ms a step, 0.05 ms a prompt token, 0.2 ms per 1000 KV tokens: a step of 1000 prompt tokens beside 50k
    # KV tokens takes 12 + 50 + 10 = 72 ms.
    truth = StepModel(12, 0.05, 2e-4)
    records = [StepRecord(p, k, truth.step_ms(p, k)) for p in (0, 256, 1000, 4096) for k in (0, 50_000, 200_000)]
    assert StepRecord(1000, 50_000, 72.0) in records
    fitted = fit_step_model(records)
    assert (fitted.base_ms, fitted.per_prefill_token_ms, fitted.per_kv_token_ms) == pytest.approx(
        (12, 0.05, 2e-4), rel=1e-3
    )


def test_a_prefill_workers_records_without_kv_fit_without_a_profile():
    records = [StepRecord(p, 0, 20 + 0.1 * p) for p in (128, 512, 2048, 8192)]
    fitted = fit_step_model(records)
    assert fitted.base_ms == pytest.approx(20, rel=1e-3)
    assert fitted.per_prefill_token_ms == pytest.approx(0.1, rel=1e-3)
    assert fitted.per_kv_token_ms == 0


def test_many_records_outweigh_the_profile():
    records = [StepRecord(p, 0, 40 + 0.2 * p) for p in (128, 512, 2048, 8192) for _ in range(100)]
    fitted = fit_step_model(records, PROFILE)
    assert fitted.per_prefill_token_ms == pytest.approx(0.2, rel=0.02)


def test_a_falling_cost_is_clipped_at_zero_not_read_as_unbounded_capacity():
    records = [StepRecord(p, 0, 30 - 0.001 * p) for p in (128, 512, 2048, 8192)]
    assert fit_step_model(records).per_prefill_token_ms == 0


@settings(max_examples=100, deadline=None)
@given(
    base=st.floats(1, 100),
    per_prefill=st.floats(1e-4, 1),
    per_kv=st.floats(1e-7, 1e-3),
    prefill=st.lists(st.integers(0, 8192), min_size=2, max_size=5, unique=True),
    kv=st.lists(st.integers(0, 500_000), min_size=2, max_size=5, unique=True),
)
def test_noise_free_records_predict_their_own_step_times(base, per_prefill, per_kv, prefill, kv):
    # Prompt and KV tokens varied independently (a grid), as a worker's steps vary them.
    truth = StepModel(base, per_prefill, per_kv)
    records = [StepRecord(p, k, truth.step_ms(p, k)) for p in prefill for k in kv]
    fitted = fit_step_model(records)
    for r in records:
        assert fitted.step_ms(r.prefill_tokens, r.kv_tokens) == pytest.approx(r.step_ms, rel=0.02, abs=0.5)
