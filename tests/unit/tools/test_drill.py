"""app.tools.drill's reading of a trickle of requests and of the head's replica health (no cluster; the drill itself
runs in test_cluster_pull.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import app.tools.drill as drill
import app.tools.metrics_text as metrics_text
from app.tools.drill import Outcome, outage_s


def _o(started, ended, ok):
    return Outcome(started, ended, ok, "x")


@pytest.mark.parametrize("outcomes, expected", [
    ([], 0.0),
    ([_o(0, 1, True), _o(1, 2, True)], 0.0),
    # from the first failure's start to the next answer's end
    ([_o(0, 1, True), _o(1, 2, False), _o(2, 3, False), _o(3, 5, True), _o(5, 6, True)], 4.0),
    # failures apart: one outage from the first to the answer after the last
    ([_o(0, 1, False), _o(1, 2, True), _o(2, 3, False), _o(3, 4, True)], 4.0),
    # no answer after the last failure: up to the last request's end
    ([_o(0, 1, True), _o(1, 2, False), _o(2, 7, False)], 6.0),
])
def test_outage_runs_from_the_first_failure_to_the_next_answer(outcomes, expected):
    assert outage_s(outcomes) == expected


_HEAD = "http://head/metrics"
_REPLICA = 'ray_serve_deployment_replica_healthy{{deployment="{d}",replica="{d}#1"}} {v}\n'


@pytest.mark.parametrize("text, healthy", [
    ("", False),  # no replica reported yet: the controller is not back
    (_REPLICA.format(d="Decode", v=1) + _REPLICA.format(d="Prefill", v=1), True),
    (_REPLICA.format(d="Decode", v=1) + _REPLICA.format(d="Prefill", v=0), False),
    # only the gauge itself counts, not a longer name it begins, nor other metrics
    (_REPLICA.format(d="Decode", v=1) + 'ray_serve_deployment_replica_healthy_x{a="b"} 0\nother{a="b"} 0\n', True),
])
def test_every_replica_healthy_is_read_from_the_heads_gauge_lines(monkeypatch, text, healthy):
    monkeypatch.setattr(metrics_text.httpx, "get", lambda url, timeout: SimpleNamespace(text=text) if url == _HEAD else None)
    assert drill.all_replicas_healthy(SimpleNamespace(metrics_url=lambda kind: _HEAD)) is healthy


def test_a_head_that_does_not_answer_is_not_healthy(monkeypatch):
    def refused(url, timeout):
        raise drill.httpx.ConnectError("refused")
    monkeypatch.setattr(metrics_text.httpx, "get", refused)
    assert drill.all_replicas_healthy(SimpleNamespace(metrics_url=lambda kind: _HEAD)) is False
