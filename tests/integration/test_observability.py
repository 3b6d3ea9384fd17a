"""The chart's dashboard and rules against a real Prometheus scraping a running router + prefill + decode.

Prometheus (built by hack/prometheus/build.sh) scrapes the three processes every second, as a Kubernetes scrape
would label them (`namespace`, `pod`), and evaluates the chart's rules (with the default thresholds). Once it has
seen the stack idle, a few streamed requests go through the router; after it has scraped what they left, every
query of the dashboard returns series, every rule evaluates without error, every recorded series is there, and
every alert's condition evaluates to a value on the live stack (false, where a healthy stack must not alert).
"""

from __future__ import annotations

import math
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from tests.integration.procs import PDStack, free_port, scaled, sse_stream, wait_until
from tests.observability import dashboard_queries, prometheus_bin, rules, rules_with_defaults

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192")
NAMESPACE = "disagg-test"
# What a healthy stack must not alert on; latency alerts depend on the machine, so only their values are checked.
QUIET = {
    "DisaggKVTransferFailures",
    "DisaggHandoffStalled",
    "DisaggNoVerifiedPair",
    "DisaggKVUsageHigh",
    "DisaggQueueGrowing",
}


class Prometheus:
    def __init__(self, targets: dict[str, tuple[str, str]], tmp: Path):
        """`targets`: pod name -> (job, URL)."""
        (tmp / "disagg.rules.yaml").write_text(rules_with_defaults())
        jobs: dict[str, list[dict]] = {}
        for pod, (job, url) in targets.items():
            target = url.removeprefix("http://")
            jobs.setdefault(job, []).append({"targets": [target], "labels": {"namespace": NAMESPACE, "pod": pod}})
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "disagg.rules.yaml")],
            "scrape_configs": [{"job_name": job, "static_configs": sc} for job, sc in jobs.items()],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                str(prometheus_bin() / "prometheus"),
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def api(self, path: str, **params: str) -> Any:
        r = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=scaled(10))
        body = r.json()
        assert body["status"] == "success", (params, body)
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def scraped_after(self, t: float, jobs: int) -> bool:
        """Every target has been scraped, up, since `t` (a `time.time()`)."""
        seen = self.query(f'up{{namespace="{NAMESPACE}"}} == 1 and timestamp(up) > {t}')
        return len(seen) == jobs

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(scaled(20))
        self.log.close()


@pytest.fixture(scope="module")
def stack(tiny_model: str) -> Iterator[PDStack]:
    s = PDStack(tiny_model, *FLAGS, router_flags=("--policy", "cache_aware", "--tokenizer", tiny_model))
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prometheus(stack: PDStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    targets = {
        "tiny-router-0": ("disagg-router", stack.router.url),
        "tiny-prefill-0": ("disagg-workers", stack.prefill.url),
        "tiny-decode-0": ("disagg-workers", stack.decode.url),
    }
    p = Prometheus(targets, tmp_path_factory.mktemp("prometheus"))
    try:
        wait_until(lambda: p.proc.poll() is None and _ready(p.url), 60, what="Prometheus ready")
        # The counters' values before the requests: a rate needs them.
        started = time.time()
        wait_until(lambda: p.scraped_after(started, 3), 30, what="the stack scraped")
        for i in range(6):
            prompt = "The same long prefix for the prefix cache, then request number " + str(i % 3)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
            resp, events = sse_stream(stack.router.url, "/v1/completions", body)
            assert resp.status_code == 200 and list(events)[-1] == "[DONE]"
        done = time.time()
        # Two scrapes after the last request, and the rules evaluated over them.
        wait_until(lambda: p.scraped_after(done + 1, 3), 30, what="the requests scraped")
        wait_until(lambda: p.query(f"timestamp(disagg:kv_usage:ratio) > {done + 1}"), 30, what="rules evaluated")
        yield p
    finally:
        p.stop()


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def finite(result: list[dict]) -> list[dict]:
    return [s for s in result if not math.isnan(float(s["value"][1]))]


@pytest.mark.parametrize("title,expr", dashboard_queries(namespace=NAMESPACE, rate_interval="1m"))
def test_every_dashboard_query_returns_series(prometheus: Prometheus, title: str, expr: str):
    result = prometheus.query(expr)
    assert finite(result), f"{title}: {expr} gave {result}"


def test_every_rule_evaluates_and_every_recorded_series_is_there(prometheus: Prometheus):
    evaluated = {r["name"]: r for g in prometheus.api("rules")["groups"] for r in g["rules"]}
    names = [r.get("record") or r["alert"] for r in rules()]
    assert sorted(evaluated) == sorted(names)
    assert {n: r["lastError"] for n, r in evaluated.items() if r["health"] != "ok"} == {}
    recorded = {r["record"]: prometheus.query(r["record"]) for r in rules() if "record" in r}
    assert {name for name, result in recorded.items() if not result} == set()
    roles = {s["metric"]["role"] for s in prometheus.query("disagg:kv_usage:ratio")}
    assert roles == {"prefill", "decode"}


def test_every_alerts_condition_has_a_value_and_a_healthy_stack_alerts_on_nothing(prometheus: Prometheus):
    values = {}
    for rule in (r for r in rules() if "alert" in r):
        # `x > 0.9` only keeps what fires; `x > bool 0.9` gives every series its condition, 1 or 0.
        condition = re.sub(r"\s(>|==)\s+(?=[0-9])", r" \1 bool ", rule["expr"])
        result = prometheus.query(condition)
        assert result, f"{rule['alert']}: {condition} gave no series"
        values[rule["alert"]] = {float(s["value"][1]) for s in result}
    assert all(v <= {0.0, 1.0} for v in values.values()), values
    assert {a: v for a, v in values.items() if a in QUIET and v != {0.0}} == {}
