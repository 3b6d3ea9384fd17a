"""What one replica sustains within the latency targets, from a step-time model.

A worker's step time is modelled as `base + per_prefill_token * P + per_kv_token * K` milliseconds, P the prompt
tokens the step computes and K the KV tokens its decode requests attend to. Why linear: a prefill step is dominated
by matrix products whose work grows with its tokens (attention's quadratic part is small next to the MLPs at the
chunk sizes served); a decode step is memory-bound, reading the weights once (the constant) and every running
request's KV (the K term). Three numbers a user can check against a profile, fitted online by `fit.py`.

Prefill within a TTFT budget T: a request that arrives just after a step starts waits for that step and then is
computed in the next, so a prefill replica keeps TTFT within T when each of its steps takes at most T/2. Its
sustainable rate is the chunk such a step computes over the step's time. A mean prompt whose computation alone
(its chunks one after another) takes more than T/2 cannot meet T on any number of replicas.

Decode within an ITL budget I: a step of at most I ms attends to at most (I - base) / per_kv_token KV tokens, i.e.
that many over the mean context (prompt + half the output) requests, each producing 1000 / I tokens a second.
Its KV pool must also hold its share of the concurrent requests at their peak (prompt + output), the concurrency
being the token rate times I (Little's law at the target).
"""

import math
from dataclasses import dataclass

INFEASIBLE = math.inf


@dataclass(frozen=True)
class StepModel:
    base_ms: float
    per_prefill_token_ms: float = 0.0
    per_kv_token_ms: float = 0.0

    def step_ms(self, prefill_tokens: float, kv_tokens: float = 0.0) -> float:
        return self.base_ms + self.per_prefill_token_ms * prefill_tokens + self.per_kv_token_ms * kv_tokens


@dataclass(frozen=True)
class CapacityModel:
    """`max_prefill_tokens`: the most prompt tokens one prefill step takes (its chunk); `decode_kv_tokens`: the KV
    tokens one decode replica's pool holds for requests."""

    prefill: StepModel
    decode: StepModel
    max_prefill_tokens: int = 8192
    decode_kv_tokens: int = 1 << 20


def prefill_chunk(model: CapacityModel, ttft_ms: float) -> float:
    """Prompt tokens one prefill step computes in at most half the TTFT budget (0: not even an empty step fits)."""
    m = model.prefill
    budget = ttft_ms / 2 - m.base_ms
    if budget <= 0:
        return 0.0
    if m.per_prefill_token_ms <= 0:
        return float(model.max_prefill_tokens)
    return min(float(model.max_prefill_tokens), budget / m.per_prefill_token_ms)


def lone_prompt_ms(model: CapacityModel, prompt: float) -> float:
    """A prompt's computation on an idle prefill: its chunks one after another."""
    steps = max(1, math.ceil(prompt / model.max_prefill_tokens))
    return steps * model.prefill.base_ms + model.prefill.per_prefill_token_ms * prompt


def prefill_rate(model: CapacityModel, chunk: float) -> float:
    """Prompt tokens per second a prefill replica computes in steps of `chunk` tokens."""
    return chunk / model.prefill.step_ms(chunk) * 1000 if chunk > 0 else 0.0


def estimated_ttft_ms(model: CapacityModel, tokens_per_s: float, prompt: float, replicas: int) -> float:
    """TTFT at `replicas` sharing `tokens_per_s`: the step in progress (of the chunk that just keeps up with the
    load) and then the prompt's own computation (at least such a step); infinite when the replicas cannot keep up
    at any chunk. Idle: the prompt's computation alone."""
    if tokens_per_s <= 0:
        return lone_prompt_ms(model, prompt)
    if replicas <= 0:
        return INFEASIBLE
    per_ms = tokens_per_s / replicas / 1000
    m = model.prefill
    spare = 1 - per_ms * m.per_prefill_token_ms
    if spare <= 0:
        return INFEASIBLE
    chunk = per_ms * m.base_ms / spare  # chunk / step_ms(chunk) == per_ms
    if chunk > model.max_prefill_tokens:
        return INFEASIBLE
    step = m.step_ms(chunk)
    return step + max(step, lone_prompt_ms(model, prompt))


def decode_kv_within(model: CapacityModel, itl_ms: float) -> float:
    """KV tokens one decode step attends to within the ITL budget (0: not even an empty step fits)."""
    m = model.decode
    budget = itl_ms - m.base_ms
    if budget <= 0:
        return 0.0
    return budget / m.per_kv_token_ms if m.per_kv_token_ms > 0 else INFEASIBLE


def estimated_itl_ms(model: CapacityModel, tokens_per_s: float, context: float, replicas: int) -> float:
    """ITL at `replicas` producing `tokens_per_s`: the fixed point of itl = base + per_kv * (concurrent / replicas)
    * context with concurrent = tokens_per_s * itl / 1000, i.e. base / (1 - x)."""
    if replicas <= 0:
        return INFEASIBLE if tokens_per_s > 0 else model.decode.base_ms
    x = model.decode.per_kv_token_ms * tokens_per_s * context / (1000 * replicas)
    return model.decode.base_ms / (1 - x) if x < 1 else INFEASIBLE
