"""bench/timeline.py: request timelines read back from an app log, and their report."""

from __future__ import annotations

import pytest


def test_timeline_report_from_log_lines(tmp_path):
    """bench timeline: timelines read back from an app log, matched by response id, medians
    per mode and kind, and the files it writes."""
    from app.request.timeline import RequestTimeline
    from bench.timeline import Sample, TimelineLoad, _engine_id, _schedule, medians, read_timelines, table, write_report

    remote = {"arrived": 0.0, "decode_received": 0.01, "legs_sent": 0.02, "prefill_queued": 0.03,
              "prefill_started": 0.05, "prefill_finished": 2.05, "first_token": 2.25, "first_chunk": 2.26}
    lines = [
        "(ServeReplica:rendezvous:OpenAiIngress pid=1) INFO -- "
        + RequestTimeline(f"rdv-{i}", "push", "remote", True, {k: v + i for k, v in remote.items()}).to_log_line()
        for i in range(3)
    ]
    log = tmp_path / "app.log"
    log.write_text("\n".join(["noise", *lines, "more noise"]))
    timelines = read_timelines(log)
    assert sorted(timelines) == ["rdv-0", "rdv-1", "rdv-2"]
    assert _engine_id("cmpl-rdv-1") == "rdv-1" and _engine_id(None) is None
    samples = [Sample("push", "long", 2.3, timelines[f"rdv-{i}"]) for i in range(3)] + [Sample("push", "short_alone", None, None)]
    m = medians(samples)[("push", "long")]
    assert m["prefill_compute"] == pytest.approx(2.0) and m["handoff"] == pytest.approx(0.2)
    assert "| push | long |" in table(samples)
    write_report(samples, tmp_path)
    assert (tmp_path / "waterfall.png").stat().st_size > 1000
    assert "prefill_compute" in (tmp_path / "timeline.csv").read_text()
    plan = _schedule(TimelineLoad(cycles=2), "m")
    assert [kind for _, kind, _ in plan] == ["long", "short_during", "short_alone"] * 2
    assert [at for at, _, _ in plan] == sorted(at for at, _, _ in plan)


def test_progressive_push_runs_with_the_chunk_size_of_every_mode_and_its_chunk_writes_are_drawn(tmp_path):
    """bench timeline --mode push-progressive: its config is push's with handoff.progressive, every mode has the same
    prefill chunk; a request's `streamed` span is drawn over its prefill."""
    import yaml

    from app.request.timeline import RequestTimeline
    from bench.timeline import CHUNK_TOKENS, MODES, Sample, TimelineLoad, _config_for, plot_waterfall

    for mode in ("push", "push-progressive"):
        args = yaml.safe_load(open(_config_for(mode, MODES[mode], TimelineLoad(), tmp_path)))["applications"][0]["args"]
        assert args["engine_kwargs"]["max_num_batched_tokens"] == CHUNK_TOKENS
        assert args.get("handoff", {}).get("progressive", False) is (mode == "push-progressive")
    stamps = {"arrived": 0.0, "decode_received": 0.01, "legs_sent": 0.02, "prefill_queued": 0.03, "prefill_started": 0.05,
              "first_chunk_landed": 1.0, "prefill_finished": 2.05, "write_started": 2.06, "kv_landed": 2.08,
              "first_token": 2.2, "first_chunk": 2.21}
    timeline = RequestTimeline("rdv-1", "push", "remote", True, stamps, chunk_writes=3)
    assert timeline.stages()["streamed"] == pytest.approx(1.05)
    assert plot_waterfall([Sample("push-progressive", "long", 2.2, timeline)], tmp_path / "w.png").stat().st_size > 1000
