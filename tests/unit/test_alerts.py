"""observability/alerts.yaml: valid for Prometheus (`promtool check rules`), each alert firing on the series it
is meant for (`promtool test rules tests/unit/alerts_test.yaml`), the operator's copy equal to it, a runbook entry
for each, and only metrics the app exports (no Prometheus server started)."""

from __future__ import annotations

import re
import subprocess

import yaml

from tests.observability import REPO, RULES, alert_rules, promtool

def test_the_rules_are_valid_prometheus_rules():
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_each_alert_fires_on_its_series_after_its_for_and_not_on_healthy_ones():
    done = subprocess.run([promtool(), "test", "rules", "alerts_test.yaml"], cwd=REPO / "tests" / "unit",
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = set(re.findall(r"alertname: (\w+)", (REPO / "tests" / "unit" / "alerts_test.yaml").read_text()))
    assert tested == {alert["alert"] for alert in alert_rules()}, "every alert needs a promtool test"


def test_the_operators_prometheusrule_holds_the_same_rules():
    rule = yaml.safe_load((REPO / "k8s" / "monitoring" / "prometheusrule.yaml").read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    kustomization = yaml.safe_load((REPO / "k8s" / "monitoring" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["prometheusrule.yaml", "podmonitor.yaml"]


def test_each_alert_has_a_severity_a_summary_and_a_runbook_entry():
    headings = {line[4:].strip().lower() for line in (REPO / "docs" / "runbook.md").read_text().splitlines()
                if line.startswith("### ")}
    for alert in alert_rules():
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        assert alert["annotations"]["runbook"] == f"docs/runbook.md#{alert['alert'].lower()}"
        assert alert["alert"].lower() in headings, f"docs/runbook.md has no entry for {alert['alert']}"


def _exported_by_the_app() -> set[str]:
    """ray_rendezvous_* names the app defines (Ray adds the prefix, Prometheus the suffixes)."""
    names = set()
    for path in (REPO / "app").rglob("*.py"):
        names |= set(re.findall(r'"(rendezvous_[a-z_]+)"', path.read_text()))
    return {f"ray_{name}" for name in names}


def test_the_rules_use_only_metrics_the_app_and_its_engines_export():
    exported = _exported_by_the_app()
    assert "ray_rendezvous_requests" in exported and "ray_rendezvous_stage_seconds" in exported
    # vLLM's NIXL counters and Serve's replica gauge, as pinned by name in bench/ (checked against a live scrape
    # by the integration suite's benchmark rows and fault tests).
    upstream = {"ray_vllm_nixl_num_failed_transfers", "ray_vllm_nixl_num_failed_notifications",
                "ray_serve_deployment_replica_healthy"}
    for alert in alert_rules():
        for metric in re.findall(r"\b(ray_[a-z_]+)", alert["expr"]):
            base = re.sub(r"_(total|bucket|count|sum)$", "", metric)
            assert base in exported | upstream, f"{alert['alert']}: {metric} is not a metric the app exports"
