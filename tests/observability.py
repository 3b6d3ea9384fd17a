"""The chart's dashboard and rules as the tests read them, and the Prometheus binaries they run.

`rules_with_defaults()` renders rules/disagg.rules.yaml as the chart's `tpl` does with the default values: the
thresholds from values.yaml, the alerts' quoted Prometheus templates unquoted, the header comment dropped (the
cluster tier checks that helm renders the same). `prometheus_bin()` builds prometheus and promtool through the Go
module proxy on first use (hack/prometheus/build.sh; `make test` builds them before pytest).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "disagg-operator"
RULES = CHART / "rules" / "disagg.rules.yaml"
DASHBOARD = CHART / "dashboards" / "disagg-model.json"
THRESHOLD = re.compile(r"\{\{\s*\.Values\.prometheusRule\.thresholds\.(\w+)\s*\}\}")
QUOTED = re.compile(r"\{\{`(.*?)`\}\}", re.DOTALL)
COMMENT = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}\n?", re.DOTALL)


def rules_with_defaults() -> str:
    thresholds = yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["thresholds"]
    text = COMMENT.sub("", RULES.read_text())
    text = THRESHOLD.sub(lambda m: str(thresholds[m[1]]), text)
    text = QUOTED.sub(lambda m: m[1], text)
    assert "{{ ." not in text and "{{`" not in text, "a template expression the tests do not render"
    return text


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(rules_with_defaults())["groups"] for r in g["rules"]]


def dashboard_queries(namespace: str = ".*", rate_interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard, its variables replaced as Grafana would."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    return [
        (title, expr.replace("$namespace", namespace).replace("$__rate_interval", rate_interval))
        for title, expr in exprs
    ]


def prometheus_bin() -> Path:
    """The directory holding prometheus and promtool."""
    proc = subprocess.run([str(REPO / "hack" / "prometheus" / "build.sh")], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"hack/prometheus/build.sh failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])
