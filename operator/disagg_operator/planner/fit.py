"""The step-time model fitted online from the workers' per-step records.

Least squares over (prefill tokens, KV tokens, step ms), pulled toward a prior: the profile's model when the user
produced one, else zeros with a tiny weight. Why a prior rather than plain least squares: a prefill worker's
records have no KV term (a column of zeros) and a decode worker's few prefill tokens barely vary, so the plain
normal equations are singular or wild; the prior acts as `prior_weight` pseudo-records at the profile's values,
so no records give the profile back, and many records outweigh it. Each column's pull is scaled by that column's
mean square, so the weight means the same for tokens counted in thousands as for the constant.

Coefficients come out clipped at zero: a negative cost per token (noise on a flat profile) would promise
unbounded capacity. Solved in plain Python (a 3x3 system): the operator image carries no numpy.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from .capacity import StepModel

DEFAULT_PRIOR_WEIGHT = 8.0
NO_PRIOR_WEIGHT = 1e-6


@dataclass(frozen=True)
class StepRecord:
    prefill_tokens: float
    kv_tokens: float
    step_ms: float


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; `a` is symmetric positive definite here (the prior's diagonal
    is positive), so a pivot is never zero."""
    m = [row[:] + [v] for row, v in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x


def fit_step_model(
    records: Sequence[StepRecord], prior: StepModel | None = None, prior_weight: float = DEFAULT_PRIOR_WEIGHT
) -> StepModel:
    weight = prior_weight if prior is not None else NO_PRIOR_WEIGHT
    theta0 = [prior.base_ms, prior.per_prefill_token_ms, prior.per_kv_token_ms] if prior else [0.0, 0.0, 0.0]
    rows = [(1.0, r.prefill_tokens, r.kv_tokens) for r in records]
    ys = [r.step_ms for r in records]
    scale = [max(1.0, sum(x[j] ** 2 for x in rows) / len(rows)) if rows else 1.0 for j in range(3)]
    a = [[sum(x[i] * x[j] for x in rows) for j in range(3)] for i in range(3)]
    b = [sum(x[i] * y for x, y in zip(rows, ys, strict=True)) for i in range(3)]
    for j in range(3):
        a[j][j] += weight * scale[j]
        b[j] += weight * scale[j] * theta0[j]
    base, per_prefill, per_kv = (max(0.0, v) for v in _solve3(a, b))
    return StepModel(base, per_prefill, per_kv)
