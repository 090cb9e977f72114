"""bench/sweep.py: run_point and run_sweep orchestration with a fake load client, fake apps and fake
engine metrics (no app, no engines)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import yaml

from app.request.envelope import Route
from app.request.timeline import LOG_MARKER, RequestTimeline
from bench.profiles import PROFILES, Mode, ProfileError, load_config
from bench.results import TRANSFER_COLUMNS, read_results, write_results
import bench.sweep as sweep
from tests.support.bench import snap, vllm_result


class FakeMetrics:
    """Engine metrics that advance when the fake client 'sends' requests."""

    def __init__(self, export_lag=False):
        self.transfers = 0
        self.export_lag = export_lag

    def snapshot(self):
        shown = self.transfers - (1 if self.export_lag and self.transfers else 0)
        return snap(shown, {"65536.0": shown, "262144.0": shown, "+Inf": shown}, replica_copy=False)

    settled_snapshot = snapshot

    def wait_for(self, predicate, timeout_s=60, poll_s=1.0):
        s = self.snapshot()
        if not predicate(s):
            raise TimeoutError("fake")
        return s


@pytest.fixture
def fake_load(monkeypatch):
    metrics = FakeMetrics()
    calls = []

    def run(load):
        calls.append(load)
        if load.result_path is not None:
            load.result_path.parent.mkdir(parents=True, exist_ok=True)
            load.result_path.write_text("{}")
        metrics.transfers += load.num_prompts
        return vllm_result(completed=load.num_prompts)

    monkeypatch.setattr(sweep.client, "run", run)
    return metrics, calls


def test_run_point_counts_the_points_transfers(fake_load, tmp_path):
    metrics, calls = fake_load
    metrics.transfers = 7  # earlier traffic
    point = sweep.run_point(
        "http://x:8000", "/tok", 1024, 0.25, 4, 32, mode="push", metrics=metrics, raw_dir=tmp_path, model="m"
    )
    assert point.row["nixl_transfers"] == 4 and point.row["transfer_metrics_settled"] is True
    assert point.row["nixl_bytes_total_bucket_lo"] == 4 * 0  # first bucket starts at 0
    assert point.row["nixl_bytes_total_bucket_hi"] == 4 * 65536
    assert (tmp_path / "push-in1024-rate0.25.json").is_file()
    assert calls[0].model == "m" and calls[0].input_len == 1024 and calls[0].rate == 0.25


def test_run_point_flags_transfers_ray_has_not_exported(fake_load):
    metrics, _ = fake_load
    metrics.export_lag = True
    point = sweep.run_point("http://x", "/tok", 256, 0.1, 3, 32, mode="pull", metrics=metrics, metrics_timeout_s=0)
    assert point.row["transfer_metrics_settled"] is False and point.row["nixl_transfers"] == 2


def test_run_point_aggregated_has_no_transfer_columns(fake_load):
    metrics, _ = fake_load
    point = sweep.run_point("http://x", "/tok", 256, 0.1, 3, 32, mode="aggregated", metrics=metrics)
    assert all(point.row[c] is None for c in TRANSFER_COLUMNS)


def _fake_apps(monkeypatch, metrics):
    started = []

    @contextlib.contextmanager
    def running_app(config_path, base_url, log_dir, link_mbit=None):
        started.append(config_path)

        class App:
            log_path = Path(log_dir) / "app.log"  # no request timelines: the exposed-transfer columns stay empty

            def metrics_url(self):
                return "http://metrics"

        App.log_path.write_text("")
        yield App()

    monkeypatch.setattr(sweep, "running_app", running_app)
    monkeypatch.setattr(sweep, "TIMELINE_WAIT_S", 0)
    monkeypatch.setattr(sweep, "RoleMetrics", lambda url: metrics)
    monkeypatch.setattr(sweep, "resolve_model_source", lambda source: "/tok")
    return started


def test_sweep_runs_every_mode_and_point_and_writes_everything(fake_load, monkeypatch, tmp_path):
    metrics, calls = fake_load
    started = _fake_apps(monkeypatch, metrics)
    profile = PROFILES["cpu-quick"]
    rows = sweep.run_sweep(profile, tmp_path, ignore_budget=True)
    # Each mode's config as run is kept with the results: the profile's file, with its overrides (none here).
    assert started == [str(tmp_path / "configs" / f"{m.value}.yaml") for m in profile.modes]
    assert all(yaml.safe_load(Path(path).read_text()) == load_config(profile.configs[m]) for path, m in zip(started, profile.modes))
    assert len(rows) == len(profile.modes) * len(profile.points())
    assert len(calls) == len(rows) + len(profile.modes) * (profile.warmups > 0)  # + one warm-up per mode
    for name in ("results.json", "results.csv", "ttft_vs_rate.png", "tpot_vs_rate.png"):
        assert (tmp_path / name).stat().st_size > 0
    pushed = [r for r in rows if r["mode"] == "push"]
    assert all(r["nixl_transfers"] == r["completed"] for r in pushed)
    # A second run of one mode adds to the same directory instead of replacing it.
    sweep.run_sweep(profile, tmp_path, modes=[Mode.PULL], ignore_budget=True)
    assert len(read_results(tmp_path)["rows"]) == len(rows)


def test_sweep_skips_what_would_overrun_the_budget(fake_load, monkeypatch, tmp_path):
    metrics, _ = fake_load
    started = _fake_apps(monkeypatch, metrics)
    profile = dataclasses.replace(PROFILES["cpu-quick"], budget_s=1)
    rows = sweep.run_sweep(profile, tmp_path)
    assert rows == [] and started == []
    assert len(read_results(tmp_path)["last_run"]["skipped"]) == len(profile.modes)


def test_sweep_refuses_a_directory_of_another_profile(fake_load, monkeypatch, tmp_path):
    metrics, _ = fake_load
    _fake_apps(monkeypatch, metrics)
    write_results(tmp_path, [], {"profile": {"name": "cpu-full"}})
    with pytest.raises(ProfileError, match="cpu-full"):
        sweep.run_sweep(PROFILES["cpu-quick"], tmp_path, ignore_budget=True)


def test_base_url_needs_exactly_one_mode(tmp_path):
    with pytest.raises(ProfileError, match="exactly one --mode"):
        sweep.run_sweep(PROFILES["cpu-quick"], tmp_path, base_url="http://x:8000")


def test_exposed_transfer_is_read_from_the_timelines_of_the_points_requests(tmp_path):
    """Prefill finished to KV landed, for the disaggregated requests that arrived during the point."""

    def line(request_id, arrived, transfer_s, route=Route.REMOTE):
        stamps = {"arrived": arrived, "prefill_finished": arrived + 1.0, "kv_landed": arrived + 1.0 + transfer_s}
        return RequestTimeline(request_id, "push", route, False, stamps).to_log_line()

    log = tmp_path / "app.log"
    log.write_text("\n".join([
        "noise", line("a", 100.0, 0.010), line("b", 101.0, 0.030), line("c", 102.0, 0.020),
        line("before", 90.0, 5.0), line("local", 101.5, 5.0, Route.LOCAL),
    ]) + "\n")
    assert LOG_MARKER in log.read_text()
    timelines = sweep._read_timelines(log)
    got = sweep.exposed_transfers(timelines, 99.0, 110.0)
    assert got["exposed_transfers"] == 3
    assert got["exposed_transfer_p50_ms"] == pytest.approx(20.0) and got["exposed_transfer_p90_ms"] == pytest.approx(30.0)
    assert sweep.exposed_transfers(timelines, 200.0, 210.0) == {"exposed_transfers": 0}
