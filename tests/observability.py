"""The observability files the tests read (alert rules, dashboard) and the Prometheus tools that check them:
one home for their paths and parsing, shared by the unit tests (promtool, structure) and the integration
test that evaluates them on a real Prometheus (tests/integration/prometheus.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "observability" / "alerts.yaml"
DASHBOARD = REPO / "observability" / "grafana-dashboard.json"
# `make install` unpacks Debian's prometheus package here (Makefile: PROMTOOL).
TOOLS_BIN = REPO / ".tools" / "prometheus" / "usr" / "bin"


def promtool() -> str:
    found = shutil.which("promtool") or (str(TOOLS_BIN / "promtool") if (TOOLS_BIN / "promtool").exists() else None)
    if found is None:
        pytest.fail("promtool is not installed: `make install` fetches Debian's prometheus package into .tools/")
    return found


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets() -> list[tuple[str, dict]]:
    """(panel title, target) of every query of the dashboard."""
    return [(p["title"], t) for p in dashboard()["panels"] if p["type"] != "row" for t in p["targets"]]


def grouping_labels(expr: str) -> set[str]:
    """Labels a query's aggregations keep (``by (...)``, ``group_left (...)``) or add (``label_replace``)."""
    kept = set()
    for labels in re.findall(r"\b(?:by|group_left)\s*\(([^)]*)\)", expr):
        kept |= {label.strip() for label in labels.split(",") if label.strip()}
    kept |= set(re.findall(r'label_replace\([^"]*"(\w+)"', expr))
    return kept


def legend_labels(target: dict) -> set[str]:
    return set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
