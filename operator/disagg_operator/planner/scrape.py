"""Observations from what the workers already export: two scrapes of their Prometheus `/metrics`, and the rates
and means between them. Pure: the operator's loop (planner_loop.py) fetches the text and keeps the last scrape.

What each figure is read from (the series `server/metrics.py` exports on every worker pod):
- arrival rate: requests finished per second on the decode pods (every request ends on decode);
- prompt tokens: prompt tokens per request on the prefill pods; the uncached share is the prompt times one minus
  the prefill pods' mean prefix-cache hit rate (a gauge);
- output tokens: tokens generated per request on the decode pods;
- TTFT at the percentile: the decode pods' `disagg_time_to_first_token_seconds` (from the request's arrival at
  decode, which the router sends it at the same time as prefill); ITL: their `disagg_inter_token_latency_seconds`.
Queued prefill tokens are not exported (the queues count requests) and are never demand anyway (inputs.py).

Counters are compared per pod: a pod in only one scrape (scaled, replaced) or whose counters went down (it
restarted) adds nothing to this interval.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .inputs import Observations

Series = Mapping[str, float]  # "name{label=value,...}" without the instance label -> value

REQUESTS = "disagg_requests_total"
PROMPT = "disagg_prompt_tokens_total"
GENERATED = "disagg_generation_tokens_total"
HIT_RATE = "disagg_prefix_cache_hit_rate"
TTFT = "disagg_time_to_first_token_seconds"
ITL = "disagg_inter_token_latency_seconds"


@dataclass(frozen=True)
class Scrape:
    """One round: each role's pods that answered -> their series; `asked`: the pods asked."""

    at_s: float
    prefill: Mapping[str, Series] = field(default_factory=dict)
    decode: Mapping[str, Series] = field(default_factory=dict)
    asked: int = 0


def _labels(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip().strip('"')
    return out


def _sample(line: str) -> tuple[str, dict[str, str], str]:
    """(name, labels, value text) of one sample line."""
    if "{" in line.split(" ", 1)[0]:
        name, _, rest = line.partition("{")
        labels_text, _, value_text = rest.partition("}")
        return name, _labels(labels_text), value_text
    name, _, value_text = line.partition(" ")
    return name, {}, value_text


def parse_metrics(text: str) -> dict[str, float]:
    """The samples of a Prometheus text exposition, keyed by name and labels (the `instance` label dropped; series
    that differ only by it are summed). Lines that do not parse are skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, labels, value_text = _sample(line)
        try:
            value = float(value_text.split()[0])
        except (IndexError, ValueError):
            continue
        kept = sorted((k, v) for k, v in labels.items() if k != "instance")
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in kept) + "}" if kept else "")
        out[key] = out.get(key, 0.0) + value
    return out


def _deltas(before: Mapping[str, Series], after: Mapping[str, Series], prefix: str) -> dict[str, float]:
    """Summed over the pods in both scrapes whose counters did not go down: series -> increase."""
    out: dict[str, float] = {}
    for pod, now in after.items():
        then = before.get(pod)
        if then is None:
            continue
        keys = [k for k in now if k.startswith(prefix)]
        if any(now[k] < then.get(k, 0.0) for k in keys):
            continue  # restarted: its counters began again
        for k in keys:
            out[k] = out.get(k, 0.0) + now[k] - then.get(k, 0.0)
    return out


def _le(key: str) -> float:
    le = key.rsplit("le=", 1)[1].rstrip("}")
    return math.inf if le == "+Inf" else float(le)


def histogram_quantile(deltas: Mapping[str, float], name: str, q: float) -> float | None:
    """The q-quantile (0..1) of a histogram's increase, interpolated within its bucket as Prometheus does; None when
    nothing was observed. Above the last finite bound: that bound."""
    buckets = sorted((_le(k), v) for k, v in deltas.items() if k.startswith(f"{name}_bucket{{"))
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = bound, count
    return lower


def derive(before: Scrape | None, after: Scrape, percentile: float) -> tuple[Observations | None, str]:
    """The interval's observations, or None and why there are none."""
    if not after.asked:
        return None, "no worker pod has an address yet"
    if not after.decode or not after.prefill:
        missing = after.asked - len(after.prefill) - len(after.decode)
        return None, f"{missing} of {after.asked} worker pods did not answer /metrics"
    if before is None:
        return None, "first scrape of the workers' metrics: rates need two"
    dt = after.at_s - before.at_s
    if dt <= 0:
        return None, "no time between two scrapes"
    dec = _deltas(before.decode, after.decode, "disagg_")
    pre = _deltas(before.prefill, after.prefill, "disagg_")
    finished = dec.get(REQUESTS, 0.0)
    if finished <= 0:
        return None, "no request finished on decode this interval"
    prompt = pre.get(PROMPT, 0.0) / pre[REQUESTS] if pre.get(REQUESTS) else 0.0
    hits = [s.get(HIT_RATE, 0.0) for s in after.prefill.values()]
    hit_rate = min(1.0, max(0.0, sum(hits) / len(hits)))
    q = percentile / 100
    ttft, itl = histogram_quantile(dec, TTFT, q), histogram_quantile(dec, ITL, q)
    obs = Observations(
        arrival_rate=finished / dt,
        uncached_prompt_tokens=prompt * (1 - hit_rate),
        prompt_tokens=prompt,
        output_tokens=dec.get(GENERATED, 0.0) / finished,
        ttft_ms=ttft * 1000 if ttft is not None else None,
        itl_ms=itl * 1000 if itl is not None else None,
    )
    return obs, f"measured on {len(after.prefill)} prefill and {len(after.decode)} decode pods"
