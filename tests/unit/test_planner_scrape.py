"""The planner's observations from two scrapes of the workers' /metrics, rendered by the workers' own metrics code
(server/metrics.py), so a renamed series fails here."""

import pytest

from disagg_operator.planner.scrape import Scrape, derive, histogram_quantile, parse_metrics
from disagg_worker.server.metrics import ServerMetrics


def serve(m: ServerMetrics, requests: int, prompt: int, output: int, ttft_s: float, itl_s: float) -> None:
    """`requests` finished requests of `prompt` and `output` tokens at the given latencies."""
    for _ in range(requests):
        m.prompt_tokens.inc(prompt)
        m.generation_tokens.inc(output)
        m.ttft.observe(ttft_s)
        for _ in range(3):
            m.itl.observe(itl_s)
        m.requests.inc()


def scraped(at: float, prefill: dict[str, ServerMetrics], decode: dict[str, ServerMetrics]) -> Scrape:
    def read(pods: dict[str, ServerMetrics]) -> dict:
        return {pod: parse_metrics(m.render().decode()) for pod, m in pods.items()}

    return Scrape(at, read(prefill), read(decode), len(prefill) + len(decode))


@pytest.fixture
def pods():
    return {"p0": ServerMetrics("p0", "prefill")}, {"d0": ServerMetrics("d0", "decode"), "d1": ServerMetrics("d1")}


def test_rates_and_means_are_the_counters_deltas_over_the_interval(pods):
    prefill, decode = pods
    serve(prefill["p0"], 5, 1000, 1, 0.2, 0.01)  # counted before the first scrape: not this interval's
    serve(decode["d0"], 5, 1000, 100, 0.2, 0.01)
    first = scraped(100.0, prefill, decode)
    serve(prefill["p0"], 20, 2000, 1, 0.2, 0.01)
    serve(decode["d0"], 10, 2000, 300, 0.3, 0.02)
    serve(decode["d1"], 10, 2000, 300, 0.3, 0.02)
    prefill["p0"].hit_rate.set(0.25)
    obs, why = derive(first, scraped(110.0, prefill, decode), 90)
    assert obs is not None, why
    assert obs.arrival_rate == pytest.approx(2.0)  # 20 finished on decode in 10 s
    assert obs.prompt_tokens == pytest.approx(2000)
    assert obs.uncached_prompt_tokens == pytest.approx(1500)  # a quarter served by the prefix cache
    assert obs.output_tokens == pytest.approx(300)
    # p90 within the (0.25, 0.5] bucket, interpolated as Prometheus does; ITL in (0.01, 0.025].
    assert 250 < obs.ttft_ms <= 500 and 10 < obs.itl_ms <= 25
    assert "1 prefill and 2 decode pods" in why


def test_the_first_scrape_an_idle_interval_and_no_answers_give_no_observations(pods):
    prefill, decode = pods
    first = scraped(100.0, prefill, decode)
    assert derive(None, first, 90) == (None, "first scrape of the workers' metrics: rates need two")
    obs, why = derive(first, scraped(110.0, prefill, decode), 90)
    assert obs is None and why == "no request finished on decode this interval"
    for before in (None, first):  # the same words whether or not a scrape came before: no status flip
        obs, why = derive(before, Scrape(110.0, {}, {}, asked=3), 90)
        assert obs is None and why == "3 of 3 worker pods did not answer /metrics"


def test_a_restarted_pod_and_a_new_one_add_nothing_to_the_interval(pods):
    prefill, decode = pods
    serve(decode["d0"], 50, 100, 10, 0.1, 0.01)
    first = scraped(0.0, prefill, decode)
    decode["d0"] = ServerMetrics("d0")  # restarted: its counters start again below the last scrape
    decode["d2"] = ServerMetrics("d2")  # new: not in the first scrape
    serve(decode["d0"], 1, 100, 10, 0.1, 0.01)
    serve(decode["d2"], 7, 100, 10, 0.1, 0.01)
    serve(decode["d1"], 4, 100, 10, 0.1, 0.01)
    obs, _ = derive(first, scraped(4.0, prefill, decode), 90)
    assert obs is not None and obs.arrival_rate == pytest.approx(1.0)  # only d1's 4 in 4 s


def test_histogram_quantile_interpolates_and_stops_at_the_last_finite_bound():
    buckets = {"h_bucket{le=0.1}": 10.0, "h_bucket{le=0.5}": 30.0, "h_bucket{le=+Inf}": 40.0}
    assert histogram_quantile(buckets, "h", 0.5) == pytest.approx(0.3)  # rank 20: halfway through (0.1, 0.5]
    assert histogram_quantile(buckets, "h", 0.99) == 0.5
    assert histogram_quantile({}, "h", 0.9) is None


def test_parse_skips_what_is_not_a_sample_and_sums_over_instances():
    text = 'a_total{instance="x"} 2\na_total{instance="y"} 3\n# HELP a x\ngarbage\nb{le="+Inf",instance="x"} 1e3\n'
    assert parse_metrics(text) == {"a_total": 5.0, "b{le=+Inf}": 1000.0}
    assert parse_metrics("c not-a-number\n") == {}
