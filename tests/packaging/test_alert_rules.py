"""The chart's Prometheus rules and Grafana dashboard, offline: promtool accepts the rules and every dashboard
query, and each alert fires on synthetic series once its condition has held for its `for`, with the labels and
summary a receiver gets, then resolves (testdata/disagg.rules.test.yaml)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.observability import dashboard_queries, prometheus_bin, rules, rules_with_defaults
from tests.timing import scaled

TESTS = Path(__file__).parent / "testdata" / "disagg.rules.test.yaml"


@pytest.fixture(scope="module")
def promtool() -> Path:
    return prometheus_bin() / "promtool"


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=scaled(120))


def test_promtool_accepts_the_rules(promtool, tmp_path):
    (tmp_path / "disagg.rules.yaml").write_text(rules_with_defaults())
    proc = run(promtool, "check", "rules", tmp_path / "disagg.rules.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_every_alert_fires_and_resolves_on_synthetic_series(promtool, tmp_path):
    (tmp_path / "disagg.rules.yaml").write_text(rules_with_defaults())
    shutil.copy(TESTS, tmp_path / TESTS.name)
    proc = run(promtool, "test", "rules", tmp_path / TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = {
        (t["alertname"], bool(t["exp_alerts"]))
        for case in yaml.safe_load(TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
    }
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert len(alerts) == 7
    assert {(a, firing) for a in alerts for firing in (True, False)} <= tested, "an alert without a firing test"


def test_every_rule_reads_only_series_its_own_group_recorded_before_it():
    """Prometheus evaluates the rules of a group in order, at one instant, and the groups side by side: a rule
    that reads a recording rule of another group (or a later one of its own) may see the value of the previous
    evaluation, and an alert's summary would then be one interval late (what made the firing test above pass
    or fail by chance)."""
    groups = yaml.safe_load(rules_with_defaults())["groups"]
    recorded = {r["record"] for g in groups for r in g["rules"] if "record" in r}
    assert len(recorded) == 5
    for group in groups:
        before: set[str] = set()
        for rule in group["rules"]:
            reads = {name for name in recorded if re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", rule["expr"])}
            name = rule.get("alert") or rule["record"]
            assert reads <= before, f"{name} in group {group['name']} reads {sorted(reads - before)} recorded elsewhere"
            if "record" in rule:
                before.add(rule["record"])


def test_every_dashboard_query_is_valid_promql(promtool, tmp_path):
    """promtool parses each query as a recording rule's expression (the real server runs them in
    tests/integration/test_observability.py)."""
    queries = dashboard_queries()
    group = {"name": "dashboard", "rules": [{"record": f"q{i}", "expr": e} for i, (_, e) in enumerate(queries)]}
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [group]}))
    proc = run(promtool, "check", "rules", tmp_path / "dashboard.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(queries) >= 30
