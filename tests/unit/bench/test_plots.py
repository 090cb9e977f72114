"""bench/plots.py: the sweep's plots, on synthetic rows."""

from __future__ import annotations

from bench.plots import plot_results
from tests.support.bench import PNG_MAGIC, synthetic_rows


def test_plots_are_non_empty_pngs(tmp_path):
    paths = plot_results(synthetic_rows(), tmp_path)
    assert sorted(p.name for p in paths) == ["tpot_vs_rate.png", "ttft_vs_rate.png"]
    for path in paths:
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_plot_tolerates_missing_values(tmp_path):
    rows = synthetic_rows()
    rows[0] = dict(rows[0], ttft_p50_ms=None, ttft_p90_ms=None)
    assert all(p.stat().st_size > 0 for p in plot_results(rows, tmp_path))


def test_the_exposed_transfer_is_drawn_where_the_rows_have_it(tmp_path):
    rows = [dict(r, exposed_transfer_p50_ms=100.0, exposed_transfer_p90_ms=120.0) if r["mode"] != "aggregated" else r
            for r in synthetic_rows()]
    paths = plot_results(rows, tmp_path)
    assert sorted(p.name for p in paths) == ["exposed_transfer_vs_rate.png", "tpot_vs_rate.png", "ttft_vs_rate.png"]
