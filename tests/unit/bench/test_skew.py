"""bench/skew.py: the skewed load, its report and the configs it derives (no app, no engines)."""

from __future__ import annotations

from bench.profiles import app_args_of, load_config


def test_skew_load_alternates_long_and_short_with_poisson_gaps():
    from bench.skew import SkewLoad, _requests

    plan = _requests(SkewLoad(requests=6, rate=2.0, short_tokens=3, long_tokens=9), "m")
    assert [kind for _, kind, _ in plan] == ["long", "short"] * 3
    assert [body["max_tokens"] for _, _, body in plan] == [9, 3] * 3
    assert all(body["ignore_eos"] and body["stream"] and body["temperature"] == 0 for _, _, body in plan)
    times = [at for at, _, _ in plan]
    assert times[0] == 0 and times == sorted(times) and len(set(times)) == 6
    assert _requests(SkewLoad(requests=6), "m") == _requests(SkewLoad(requests=6), "m")  # same seed, same load


def test_skew_report_table_and_percentiles():
    from bench.skew import Placement, percentiles, table

    assert percentiles([]) == {}
    assert percentiles([float(v) for v in range(1, 101)]) == {"p50": 51.0, "p90": 90.0, "p99": 99.0}
    p = Placement("round_robin", ttft_ms={"short": {"p50": 1, "p90": 2, "p99": 3}, "long": {}}, tpot_ms={"short": {}, "long": {}})
    lines = table([p]).splitlines()
    assert lines[0].startswith("| placement") and "| round_robin | short | 1 / 2 / 3 |" in lines[2]


def test_skew_sets_the_decode_router_of_the_config(tmp_path):
    from app.config.args import DecodeRouter
    from bench.skew import PLACEMENTS, _config_with

    assert set(PLACEMENTS) == {r.value for r in DecodeRouter}
    derived = _config_with("configs/local-cpu-1p2d.yaml", "round_robin", tmp_path)
    assert app_args_of(load_config(derived)).routing.decode_router is DecodeRouter.ROUND_ROBIN
