"""observability/grafana-dashboard.json: importable by Grafana (schema, datasource variable, unique ids,
grid), every query valid PromQL (promtool) and every legend label one its query keeps. What the queries return
on a live app is checked against a real Prometheus by tests/integration/push/test_observability.py."""

from __future__ import annotations

import subprocess

import yaml

from tests.observability import dashboard, dashboard_targets as targets, grouping_labels, legend_labels, promtool

ROWS = ["Is it serving?", "Where does the time go?", "Is KV moving?", "Are conversations reusing?", "Is placement balanced?"]


def test_grafana_can_import_it():
    d = dashboard()
    assert d["uid"] == "rendezvous" and d["schemaVersion"] >= 36 and d["title"]
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource"]
    assert d["templating"]["list"][0]["type"] == "datasource" and d["templating"]["list"][0]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["type"] == "timeseries" and p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]


def test_it_is_organised_by_the_questions_an_on_call_asks():
    assert [p["title"] for p in dashboard()["panels"] if p["type"] == "row"] == ROWS


def test_every_query_is_valid_promql(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"panel_{i}", "expr": t["expr"]} for i, (_, t) in enumerate(targets())]}]}
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_legend_label_is_one_its_query_keeps():
    for title, target in targets():
        missing = legend_labels(target) - grouping_labels(target["expr"])
        assert not missing, f"{title}: legend uses {missing}, which {target['expr']} does not keep"


def test_load_is_shown_per_replica_and_engine_latency_per_role():
    by_title = {title: target for title, target in targets()}
    load = [t for title, t in targets() if title.startswith("Decode load per replica")]
    assert load and all("by (replica)" in t["expr"] for t in load)  # Serve's label; vLLM's is ReplicaId
    assert "role" in grouping_labels(by_title["Engine TTFT p99 by role (decode's includes its wait for KV)"]["expr"])
