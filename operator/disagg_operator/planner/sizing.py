"""The slow loop: each role sized from the predicted load over what one replica sustains within the SLO.

Prefill: predicted uncached prompt tokens per second over one prefill's rate within the TTFT budget. Decode: the
larger of the ITL-bound count (output tokens per second over one decode's rate within the ITL budget) and the
KV-bound count (the concurrent requests' peak KV over one decode's pool). A target no replica count meets (one
empty step already over it, or a mean prompt that cannot be computed in time) is reported as infeasible and sized
by throughput alone (prefill: at its full chunk; decode: by its KV pool), never sent to the maximum: more
replicas would not help.
"""

import math
from dataclasses import dataclass

from . import capacity as C
from .inputs import Observations, Slo

EPS = 1e-9


@dataclass(frozen=True)
class Need:
    replicas: int
    reason: str
    feasible: bool = True


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - EPS))


def size_prefill(obs: Observations, model: C.CapacityModel, slo: Slo) -> Need:
    demand = obs.arrival_rate * obs.uncached_prompt_tokens
    chunk = C.prefill_chunk(model, slo.ttft_ms)
    alone = C.lone_prompt_ms(model, obs.uncached_prompt_tokens)
    if chunk <= 0 or alone > slo.ttft_ms / 2:
        rate = C.prefill_rate(model, model.max_prefill_tokens)
        n = _ceil(demand / rate) if rate > 0 else 0
        why = (
            f"TTFT {slo.ttft_ms:g} ms cannot be met: a {obs.uncached_prompt_tokens:.0f}-token prompt alone "
            f"takes {alone:.0f} ms, over half the budget; "
            f"sized by throughput ({demand:.0f} tok/s over {rate:.0f} tok/s per prefill)"
        )
        return Need(n, why, feasible=False)
    rate = C.prefill_rate(model, chunk)
    n = _ceil(demand / rate)
    return Need(n, f"prefill {demand:.0f} uncached tok/s over {rate:.0f} tok/s per prefill within TTFT -> {n}")


def decode_context(obs: Observations) -> float:
    """A decoding request's mean context: its whole prompt plus half its answer."""
    return obs.prompt_tokens + obs.output_tokens / 2


def size_decode(obs: Observations, model: C.CapacityModel, slo: Slo) -> Need:
    tokens_per_s = obs.arrival_rate * obs.output_tokens
    concurrent = tokens_per_s * slo.itl_ms / 1000
    kv_need = _ceil(concurrent * (obs.prompt_tokens + obs.output_tokens) / model.decode_kv_tokens)
    kv_why = f"KV for {concurrent:.0f} concurrent requests -> {kv_need}"
    kv_budget = C.decode_kv_within(model, slo.itl_ms)
    if kv_budget <= 0:
        why = (
            f"ITL {slo.itl_ms:g} ms cannot be met: an empty decode step takes {model.decode.base_ms:g} ms; "
            f"sized by {kv_why}"
        )
        return Need(kv_need, why, feasible=False)
    per_replica = kv_budget / decode_context(obs) * 1000 / slo.itl_ms if obs.arrival_rate > 0 else C.INFEASIBLE
    itl_need = _ceil(tokens_per_s / per_replica) if math.isfinite(per_replica) else 0
    n = max(itl_need, kv_need)
    why = f"decode {tokens_per_s:.0f} tok/s over {per_replica:.0f} tok/s per decode within ITL -> {itl_need}; {kv_why}"
    return Need(n, why)
