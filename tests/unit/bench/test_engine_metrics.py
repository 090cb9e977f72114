"""bench/engine_metrics.py: parsing Ray's Prometheus text, snapshots by role, and waiting for
metrics to settle, on synthetic text and a fake clock (no app, no HTTP server)."""

from __future__ import annotations

import math

import pytest

import app.tools.metrics_text as metrics_text
import bench.engine_metrics as em
from bench.engine_metrics import (
    EXPORT_INTERVAL_ENV,
    RoleMetrics,
    counted_by,
    histogram_estimate,
    parse,
    samples_named,
    scrape,
    settle,
    total_delta,
)
from tests.support.bench import snap

INF = math.inf

# (exposition text, the samples parse() returns)
PARSE_CASES = {
    "counter, names kept as exported": (
        "# HELP ray_serve_num_http_requests_total Requests.\n"
        "# TYPE ray_serve_num_http_requests_total counter\n"
        'ray_serve_num_http_requests_total{route="/v1",method="POST"} 3.0\n',
        [("ray_serve_num_http_requests_total", {"route": "/v1", "method": "POST"}, 3.0)],
    ),
    "escaped quote, backslash and newline; commas, equals and braces inside a value": (
        'm{a="say \\"hi\\"",b="C:\\\\dir",c="x,y=z}",d="two\\nlines"} 1\n',
        [("m", {"a": 'say "hi"', "b": "C:\\dir", "c": "x,y=z}", "d": "two\nlines"}, 1.0)],
    ),
    "histogram: buckets with +Inf, sum and count": (
        "# TYPE ray_vllm_x histogram\n"
        'ray_vllm_x_bucket{ReplicaId="r1",le="0.5"} 1.0\n'
        'ray_vllm_x_bucket{ReplicaId="r1",le="+Inf"} 2.0\n'
        'ray_vllm_x_sum{ReplicaId="r1"} 0.75\n'
        'ray_vllm_x_count{ReplicaId="r1"} 2.0\n',
        [
            ("ray_vllm_x_bucket", {"ReplicaId": "r1", "le": "0.5"}, 1.0),
            ("ray_vllm_x_bucket", {"ReplicaId": "r1", "le": "+Inf"}, 2.0),
            ("ray_vllm_x_sum", {"ReplicaId": "r1"}, 0.75),
            ("ray_vllm_x_count", {"ReplicaId": "r1"}, 2.0),
        ],
    ),
    "special values and exponents": (
        'g{k="inf"} +Inf\ng{k="-inf"} -Inf\ng{k="exp"} 1.5e3\ng{k="neg"} -2\n',
        [("g", {"k": "inf"}, INF), ("g", {"k": "-inf"}, -INF), ("g", {"k": "exp"}, 1500.0), ("g", {"k": "neg"}, -2.0)],
    ),
    "samples without labels are left out, as before": (
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\nup 1\n"
        'python_gc_objects_collected_total{generation="0"} 7.0\n',
        [("python_gc_objects_collected_total", {"generation": "0"}, 7.0)],
    ),
    "comments and blank lines": ("# a comment\n\n# HELP g help\n", []),
}


@pytest.mark.parametrize("text, expected", PARSE_CASES.values(), ids=PARSE_CASES.keys())
def test_parse(text, expected):
    got = parse(text)
    assert got == expected
    assert all(type(value) is float for _, _, value in got)  # "3" is 3.0, as the regex parser gave


def test_parse_nan():
    ((name, labels, value),) = parse('ray_vllm_x_sum{ReplicaId="r1"} NaN\n')
    assert (name, labels) == ("ray_vllm_x_sum", {"ReplicaId": "r1"}) and math.isnan(value)


PAGE = """\
# TYPE ray_serve_deployment_request_counter_total counter
ray_serve_deployment_request_counter_total{deployment="Prefill:abc",replica="p1",route="/"} 4.0
ray_serve_deployment_request_counter_total{deployment="Decode:abc",replica="d1",route="/"} 5.0
ray_serve_deployment_replica_starts_total{deployment="Prefill:abc",replica="p1"} 1.0
ray_serve_deployment_replica_starts_total{deployment="Decode:abc",replica="d1"} 1.0
# TYPE ray_vllm_request_success_total counter
ray_vllm_request_success_total{ReplicaId="p1",finished_reason="length"} 4.0
ray_vllm_request_success_total{ReplicaId="d1",finished_reason="length"} 3.0
ray_vllm_request_success_total{ReplicaId="d1",finished_reason="stop"} 2.0
# TYPE ray_vllm_nixl_bytes_transferred histogram
ray_vllm_nixl_bytes_transferred_bucket{ReplicaId="p1",le="1024.0"} 1.0
ray_vllm_nixl_bytes_transferred_bucket{ReplicaId="p1",le="+Inf"} 2.0
ray_vllm_nixl_bytes_transferred_count{ReplicaId="p1"} 2.0
ray_vllm_gpu_cache_usage_perc{ReplicaId="gone"} 0.5
# TYPE ray_vllm_prompt_tokens_by_source_total counter
ray_vllm_prompt_tokens_by_source_total{ReplicaId="d1",source="local_compute"} 1.0
ray_vllm_prompt_tokens_by_source_total{ReplicaId="d1",source="external_kv_transfer"} 99.0
"""


class _Text:
    """What httpx.get returns, as far as bench.engine_metrics reads it."""

    def __init__(self, text: str):
        self.text = text


@pytest.fixture
def page(monkeypatch):
    """Every endpoint serves PAGE (a second URL: a second copy)."""
    monkeypatch.setattr(metrics_text.httpx, "get", lambda url, timeout: _Text(PAGE))


def test_a_snapshot_of_some_metrics_reads_only_them_and_still_knows_the_roles(page):
    assert RoleMetrics("http://x/metrics").snapshot("request_success_total") == {
        "prefill": {"request_success_total": 4.0}, "replica:p1": {"request_success_total": 4.0},
        "decode": {"request_success_total": 5.0}, "replica:d1": {"request_success_total": 5.0},
    }


def test_snapshot_maps_replicas_to_roles(page):
    snap = RoleMetrics("http://x/metrics").snapshot()
    assert snap["prefill"] == {
        "request_success_total": 4.0,
        "nixl_bytes_transferred_bucket[le=1024.0]": 1.0,
        "nixl_bytes_transferred_bucket[le=+Inf]": 2.0,
        "nixl_bytes_transferred_count": 2.0,
    }
    by_source = {"prompt_tokens_by_source_total[source=local_compute]": 1.0,  # kept apart by source
                 "prompt_tokens_by_source_total[source=external_kv_transfer]": 99.0}
    assert snap["decode"] == {"request_success_total": 5.0, **by_source}
    assert snap["replica:d1"] == {"request_success_total": 5.0, **by_source}
    assert snap["unknown"] == {"gpu_cache_usage_perc": 0.5}
    assert RoleMetrics(["http://a/metrics", "http://b/metrics"]).snapshot()["decode"] == {
        "request_success_total": 10.0, **{key: 2 * value for key, value in by_source.items()}}


def test_counted_by(page):
    assert counted_by("http://x/metrics", "ray_vllm_request_success_total", "finished_reason") == {"length": 7.0, "stop": 2.0}


# --------------------------------------------------------------------------- settle


class Clock:
    """time.monotonic and time.sleep of bench.engine_metrics, sleeping instantly."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        self.sleeps: list[float] = []
        monkeypatch.setattr(em.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(em.time, "sleep", self.sleep)

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def reader(clock: Clock, values_by_time):
    """read() returning the value for the current time: values_by_time is [(from_t, value)]."""
    def read():
        t = clock.now - 1000.0
        return [v for since, v in values_by_time if since <= t][-1]
    return read


@pytest.mark.parametrize(
    "changes, quiet_s, poll_s, expected_value, expected_elapsed",
    [
        ([(0, "a")], 12, 2, "a", 12),  # quiet from the start
        ([(0, "a"), (4, "b")], 12, 2, "b", 16),  # seen at 4, quiet 12 more
        ([(0, "a"), (3, "b"), (9, "c")], 10, 1, "c", 19),
    ],
)
def test_settle_waits_for_quiet(monkeypatch, changes, quiet_s, poll_s, expected_value, expected_elapsed):
    clock = Clock(monkeypatch)
    got = settle(reader(clock, changes), quiet_s=quiet_s, poll_s=poll_s, timeout_s=90)
    assert got == expected_value
    assert clock.now - 1000.0 == expected_elapsed
    assert set(clock.sleeps) == {poll_s}


def test_settle_times_out_by_raising_or_returning(monkeypatch):
    clock = Clock(monkeypatch)
    changing = lambda: clock.now  # noqa: E731  never the same twice
    with pytest.raises(TimeoutError, match="engine metrics kept changing"):
        settle(changing, quiet_s=12, poll_s=2, timeout_s=90, what="engine metrics")
    assert 90 < clock.now - 1000.0 <= 94
    start = clock.now
    assert settle(changing, quiet_s=10, poll_s=1, timeout_s=90, on_timeout="return") == clock.now
    assert 90 < clock.now - start <= 92
    with pytest.raises(ValueError):
        settle(changing, quiet_s=1, poll_s=1, timeout_s=1, on_timeout="ignore")


def test_settle_without_a_timeout_keeps_waiting(monkeypatch):
    clock = Clock(monkeypatch)
    read = lambda: min(clock.now - 1000.0, 500.0)  # noqa: E731  changes at every poll until 500 s
    assert settle(read, quiet_s=12, poll_s=2, timeout_s=None) == 500.0
    assert clock.now - 1000.0 == 512


@pytest.mark.parametrize("interval_ms, quiet_s", [(None, 12.0), ("2000", 4.0), ("250", 3.0)])
def test_settled_snapshot_waits_one_ray_export_interval_and_a_margin_of_quiet(monkeypatch, interval_ms, quiet_s):
    """Ray's export interval comes from the environment the app started in (10 s by default, floored at 1 s)."""
    if interval_ms is None:
        monkeypatch.delenv(EXPORT_INTERVAL_ENV, raising=False)
    else:
        monkeypatch.setenv(EXPORT_INTERVAL_ENV, interval_ms)
    clock = Clock(monkeypatch)
    metrics = RoleMetrics("http://x/metrics")
    monkeypatch.setattr(metrics, "snapshot", reader(clock, [(0, {"decode": {"a": 1.0}}), (2, {"decode": {"a": 2.0}})]))
    waited_before = em.waited_s
    assert metrics.settled_snapshot() == {"decode": {"a": 2.0}}
    assert clock.now - 1000.0 == 2 + quiet_s and set(clock.sleeps) == {1}
    # The suite's time report (tests/support/module_times.py) counts it as waiting for metrics.
    assert em.waited_s - waited_before == 2 + quiet_s
    monkeypatch.setattr(metrics, "snapshot", lambda: {"decode": {"a": clock.now}})
    with pytest.raises(TimeoutError, match="^engine metrics kept changing; is something else sending requests\\?$"):
        metrics.settled_snapshot(timeout_s=30)


def test_scrape_of_some_names_keeps_exactly_their_samples(monkeypatch):
    """Lines are picked out before parsing (Ray's endpoint is a megabyte): the same samples as a full parse."""
    text = "".join(body for body, _ in PARSE_CASES.values())
    monkeypatch.setattr(metrics_text.httpx, "get", lambda url, timeout: _Text(text))
    everything = scrape("http://a")
    for names in [("ray_serve_",), ("ray_vllm_", "ray_serve_num"), ("ray_nothing",)]:
        assert scrape("http://a", *names) == [s for s in everything if s[0].startswith(names)]


def test_samples_named_keeps_that_name_only_not_the_longer_ones_it_begins():
    text = ('ray_x_total{a="1"} 2\nray_x_total_created{a="1"} 1.7e9\nray_x_total{a="2"} 3\n'
            'ray_x_totals{a="3"} 4\n# TYPE ray_y counter\nray_y{a="1"} 5\n')
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics_text.httpx, "get", lambda url, timeout: _Text(text))
        assert samples_named("http://a", "ray_x_total") == [({"a": "1"}, 2.0), ({"a": "2"}, 3.0)]
        assert samples_named("http://a", "ray_z") == []


# --------------------------------------------------------------------------- deltas between snapshots


def test_histogram_estimate_uses_bucket_edges_and_midpoints():
    before = snap(1, {"2048.0": 1, "8192.0": 1, "32768.0": 1, "+Inf": 1})
    # +2 in (2048, 8192], +1 in (8192, 32768]; cumulative counts.
    after = snap(4, {"2048.0": 1, "8192.0": 3, "32768.0": 4, "+Inf": 4})
    est = histogram_estimate(after, before, "nixl_bytes_transferred")
    assert est.count == 3
    assert est.low == 2 * 2048 + 8192
    assert est.high == 2 * 8192 + 32768
    assert est.mid == 2 * (2048 + 8192) / 2 + (8192 + 32768) / 2
    assert est.mean == est.mid / 3


def test_histogram_estimate_above_the_last_bucket_has_no_upper_bound():
    est = histogram_estimate(snap(1, {"1024.0": 0, "+Inf": 1}), snap(0, {"1024.0": 0, "+Inf": 0}), "nixl_bytes_transferred")
    assert est.count == 1 and est.low == 1024 and est.high is None


def test_totals_count_each_sample_once():
    after, before = snap(5, failed=1), snap(2)
    assert total_delta(after, before, "nixl_xfer_time_seconds_count") == 3  # not 6: replica entries are skipped
    assert total_delta(after, before, "nixl_num_failed_transfers_total", "nixl_num_failed_transfers") == 1
