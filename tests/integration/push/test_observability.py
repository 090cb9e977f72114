"""What an on-call sees of the push app (tests/integration/push), last in the package on purpose (modules run
in name order): the dashboard and alerts on a real Prometheus after all the package's traffic, then readiness
while no decode replica can serve (it replaces the decode replica, whose counters vanish with it)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import signal
import threading
import time

import pytest

from bench.engine_metrics import counted_by
from bench.faults import healthy_replicas, wait_replaced, worker_pid

from tests.integration.cases import CASE_BY_NAME, assert_token_identical
from tests.observability import alert_rules, dashboard_targets, legend_labels


def test_every_dashboard_panel_and_alert_works_on_a_real_prometheus(client):
    """observability/: after the package's traffic (conversations and faults included), each dashboard query returns the
    series it is meant to show, with the labels its legend uses (a `or vector(0)` panel may show its zero
    instead, for an event that has not happened); the load panel has one series per decode replica and the
    engine panels one per role; every alert rule evaluates without error, and no decode replica was ever missing.
    Queried under light traffic: Ray exports an engine's gauges (KV cache usage) only while the engine steps."""
    prometheus = client.prometheus
    with _light_traffic(client):
        _check_dashboard_and_alerts(prometheus)


@contextlib.contextmanager
def _light_traffic(client):
    """Short completions one after another while the block runs, from its start on for two scrapes."""
    stop = threading.Event()

    def send():
        while not stop.is_set():
            assert client.post("/v1/completions", json=CASE_BY_NAME["completion-short"].body(max_tokens=4)).status_code == 200

    with cf.ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send)
        scraped = client.prometheus.scrapes()
        deadline = time.monotonic() + 60
        while client.prometheus.scrapes() < scraped + 2 and time.monotonic() < deadline:
            time.sleep(1)
        try:
            yield
        finally:
            stop.set()
            sending.result()


def _check_dashboard_and_alerts(prometheus) -> None:
    for title, target in dashboard_targets():
        series = prometheus.query(target["expr"])
        assert series, f"{title}: `{target['expr']}` returned no series"
        for one in series:
            missing = legend_labels(target) - set(one["metric"])
            assert not missing or (one["metric"] == {} and float(one["value"][1]) == 0), f"{title}: {one} lacks {missing}"
    decode_replicas = {s["metric"]["replica"] for s in prometheus.query(
        'ray_serve_deployment_replica_healthy{deployment=~"Decode:.*"} == 1')}
    load = [t for title, t in dashboard_targets() if title.startswith("Decode load per replica")][0]
    assert {s["metric"]["replica"] for s in prometheus.query(load["expr"])} == decode_replicas and len(decode_replicas) == 1
    ttft = [t for title, t in dashboard_targets() if title.startswith("Engine TTFT p99 by role")][0]
    assert {s["metric"]["role"] for s in prometheus.query(ttft["expr"])} == {"Prefill", "Decode"}
    rules = prometheus.alerting_rules()
    assert len(rules) == len(alert_rules()) and all(rule["health"] == "ok" for rule in rules), rules
    # The faults and the overload above may rightly leave warnings pending; the app never stopped serving.
    assert [rule["state"] for rule in rules if rule["name"] == "RendezvousNoDecodeReplica"] == ["inactive"], rules


@pytest.mark.slow
def test_while_no_decode_replica_can_serve_ready_is_503_and_generation_a_quick_503(client, reference):
    """Readiness after a loss (app.ingress.readiness): SIGKILL the only decode replica. /ready turns
    503 and says what is missing; a generation request meanwhile gets a quick 503 with
    Retry-After (not a wait in a queue); once Serve's replacement serves, /ready is 200
    again and answers are token-identical."""
    replicas = healthy_replicas(client.metrics.url, "Decode")
    assert len(replicas) == 1 and client.http.get("/ready").status_code == 200, replicas
    os.kill(worker_pid(next(iter(replicas.values()))), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (ready := client.http.get("/ready")).status_code == 200:
        assert time.monotonic() < deadline, "/ready still 200 a minute after the only decode replica died"
        time.sleep(0.5)
    assert ready.status_code == 503 and ready.json()["ready"] is False and ready.json()["decode_replicas"] == 0, ready.json()
    case = CASE_BY_NAME["completion-short"]
    started = time.monotonic()
    refused = client.post(case.endpoint, json=case.body(), timeout=30)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0, refused.text
    assert refused.json()["error"]["type"] == "server_error" and time.monotonic() - started < 5
    rejected = lambda: counted_by(client.metrics.url, "ray_rendezvous_ingress_rejected_total", "reason")["not_ready"]  # noqa: E731
    deadline = time.monotonic() + 60  # Ray exports metrics every few seconds
    while rejected() < 1:
        assert time.monotonic() < deadline, "the 503 was not counted as reason=not_ready"
        time.sleep(2)
    wait_replaced(client.metrics.url, "Decode", gone=set(replicas), count=1)
    deadline = time.monotonic() + 120
    while client.http.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the replacement decode replica is healthy but /ready is not 200"
        time.sleep(2)
    assert_token_identical(client, reference, case)
