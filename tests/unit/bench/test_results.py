"""bench/results.py: result rows from vLLM's benchmark results, and their CSV and JSON, on synthetic
data (no app, no engines)."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest

from bench.results import COLUMNS, TRANSFER_COLUMNS, Transfers, make_row, merge_rows, read_results, write_results
from tests.support.bench import synthetic_rows, vllm_result


def test_row_maps_vllm_percentiles_and_transfers():
    row = make_row("push", 1024, 0.25, 32, vllm_result(), Transfers(4, 1, 4e6, 6e6, 8e6, 0.002, True))
    assert list(row) == COLUMNS
    assert row["ttft_p50_ms"] == 100.0 and row["ttft_p90_ms"] == 150.0 and row["ttft_p99_ms"] == 200.0
    assert row["tpot_p99_ms"] == 40.0 and row["e2el_p50_ms"] == 100.0 + 31 * 20.0
    assert row["completed"] == 4 and row["failed"] == 0 and row["num_prompts"] == 4
    assert row["mean_input_tokens"] == 256
    assert row["nixl_transfers"] == 4 and row["nixl_failed_transfers"] == 1
    assert row["nixl_bytes_per_transfer_est_bucket_mid"] == 1.5e6
    assert row["nixl_xfer_time_mean_ms_est_bucket_mid"] == pytest.approx(2.0)


def test_row_without_transfers_and_non_finite_numbers():
    row = make_row("aggregated", 256, 0.1, 32, vllm_result(p99_tpot_ms=float("nan"), completed=0, failed=3), None)
    assert all(row[c] is None for c in TRANSFER_COLUMNS)
    assert row["tpot_p99_ms"] is None
    assert row["mean_input_tokens"] is None and row["failed"] == 3


def test_estimated_byte_columns_say_so_in_their_names():
    bytes_columns = [c for c in COLUMNS if "bytes" in c]
    assert bytes_columns and all("bucket" in c for c in bytes_columns)


def test_results_json_and_csv_are_well_formed(tmp_path):
    rows = synthetic_rows()
    random.Random(1).shuffle(rows)
    json_path, csv_path = write_results(tmp_path, rows, {"profile": {"name": "cpu-quick"}})
    doc = json.loads(json_path.read_text())
    assert doc["columns"] == COLUMNS and "nixl_bytes" in doc["notes"]
    assert [r["mode"] for r in doc["rows"]][:4] == ["push"] * 4  # sorted: push, pull, aggregated
    with open(csv_path) as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        csv_rows = list(reader)
    assert len(csv_rows) == len(rows)
    for row in csv_rows:
        for column in ("ttft_p50_ms", "tpot_p90_ms", "request_throughput_rps"):
            assert math.isfinite(float(row[column]))
        if row["mode"] == "aggregated":
            assert row["nixl_transfers"] == ""
        else:
            assert int(row["nixl_transfers"]) == 4
    assert read_results(tmp_path)["rows"] == doc["rows"]


def test_a_new_run_replaces_rows_of_the_same_point():
    old = synthetic_rows()
    new = [dict(old[0], ttft_p50_ms=1.0)]
    merged = merge_rows(old, new)
    assert len(merged) == len(old)
    assert [r for r in merged if r["ttft_p50_ms"] == 1.0] == new


def test_read_results_says_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="bench sweep"):
        read_results(tmp_path)
