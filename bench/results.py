"""One row per (mode, input length, request rate), and results.json / results.csv (pure).

Latencies and throughput come from vLLM's benchmark client. Transfer figures come from
the engines' NIXL metrics as exported by Ray: counts are exact, but Ray exports histogram
sums from bucket midpoints, so byte totals and transfer times are *estimates* derived from
bucket counts; the column names say so (``..._est_bucket_mid``, ``..._lo``, ``..._hi``).
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1
PERCENTILES = (50, 90, 99)  # asked of vLLM's benchmark client
LATENCIES = ("ttft", "tpot", "itl", "e2el")
MODE_ORDER = ("push-progressive", "push", "pull", "aggregated")

KEY_COLUMNS = ["mode", "input_len", "request_rate", "output_len", "num_prompts"]
LATENCY_COLUMNS = [f"{m}_p{p}_ms" for m in LATENCIES for p in PERCENTILES] + [f"{m}_mean_ms" for m in LATENCIES]
LOAD_COLUMNS = [
    "completed",
    "failed",
    "duration_s",
    "request_throughput_rps",
    "output_throughput_tps",
    "total_token_throughput_tps",
    "mean_input_tokens",
]
TRANSFER_COLUMNS = [
    "nixl_transfers",
    "nixl_failed_transfers",
    "nixl_bytes_total_est_bucket_mid",
    "nixl_bytes_total_bucket_lo",
    "nixl_bytes_total_bucket_hi",
    "nixl_bytes_per_transfer_est_bucket_mid",
    "nixl_xfer_time_mean_ms_est_bucket_mid",
    "transfer_metrics_settled",
]
# From the request timelines in the app's log (app.request.timeline), where the sweep started the app.
EXPOSED_COLUMNS = ["exposed_transfer_p50_ms", "exposed_transfer_p90_ms", "exposed_transfers"]
COLUMNS = KEY_COLUMNS + LOAD_COLUMNS + LATENCY_COLUMNS + TRANSFER_COLUMNS + EXPOSED_COLUMNS
NOTES = {
    "latencies": "client-side, from vLLM's benchmark (vllm.benchmarks.serve); warm-up requests excluded",
    "nixl_transfers": "exact: NIXL transfer count (histogram _count) over the point, all engines",
    "nixl_bytes": "estimates from histogram bucket counts (Ray exports histogram sums as bucket midpoints): "
    "_est_bucket_mid puts each transfer at its bucket's midpoint, _lo/_hi at its bucket's edges "
    "(_hi empty if a transfer landed above the last bucket)",
    "nixl_xfer_time": "mean transfer time from bucket counts, each at its bucket's midpoint (an estimate)",
    "transfer_metrics_settled": "false if Ray's export did not show every transfer of the point within the wait",
    "exposed_transfer": "prefill finished to KV landed on decode (the transfer left on the critical path), per request "
    "of the point, from the app log's request timelines: p50, p90 and how many requests had both stamps",
}


@dataclass(frozen=True)
class Transfers:
    """NIXL figures over one point (None where the app does not transfer: aggregated)."""

    count: int
    failed: int
    bytes_lo: float
    bytes_mid: float
    bytes_hi: float | None
    time_mean_s: float | None
    settled: bool


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def make_row(
    mode: str, input_len: int, rate: float, output_len: int, result: Mapping[str, Any], transfers: Transfers | None
) -> dict[str, Any]:
    """A results row from vLLM's result dict and the point's transfer figures."""
    completed = int(result.get("completed", 0))
    row: dict[str, Any] = {
        "mode": mode,
        "input_len": int(input_len),
        "request_rate": float(rate),
        "output_len": int(output_len),
        "num_prompts": int(result.get("num_prompts", completed + int(result.get("failed", 0)))),
        "completed": completed,
        "failed": int(result.get("failed", 0)),
        "duration_s": result.get("duration"),
        "request_throughput_rps": result.get("request_throughput"),
        "output_throughput_tps": result.get("output_throughput"),
        "total_token_throughput_tps": result.get("total_token_throughput"),
        "mean_input_tokens": result["total_input_tokens"] / completed if completed and "total_input_tokens" in result else None,
    }
    for metric in LATENCIES:
        for p in PERCENTILES:
            row[f"{metric}_p{p}_ms"] = result.get(f"p{p}_{metric}_ms")
        row[f"{metric}_mean_ms"] = result.get(f"mean_{metric}_ms")
    if transfers is None:
        row.update({column: None for column in TRANSFER_COLUMNS})
    else:
        row.update(
            {
                "nixl_transfers": transfers.count,
                "nixl_failed_transfers": transfers.failed,
                "nixl_bytes_total_est_bucket_mid": transfers.bytes_mid,
                "nixl_bytes_total_bucket_lo": transfers.bytes_lo,
                "nixl_bytes_total_bucket_hi": transfers.bytes_hi,
                "nixl_bytes_per_transfer_est_bucket_mid": transfers.bytes_mid / transfers.count if transfers.count else None,
                "nixl_xfer_time_mean_ms_est_bucket_mid": None if transfers.time_mean_s is None else transfers.time_mean_s * 1e3,
                "transfer_metrics_settled": transfers.settled,
            }
        )
    return {column: _finite(row.get(column)) for column in COLUMNS}


def sort_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    def key(row):
        mode = row["mode"]
        rank = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
        return (rank, mode, row["input_len"], row["request_rate"])

    return [dict(r) for r in sorted(rows, key=key)]


def merge_rows(old: Iterable[Mapping[str, Any]], new: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``new`` replaces every old row of the same (mode, input_len, request_rate)."""
    merged = {(r["mode"], r["input_len"], r["request_rate"]): dict(r) for r in old}
    merged.update({(r["mode"], r["input_len"], r["request_rate"]): dict(r) for r in new})
    return sort_rows(merged.values())


def write_results(out_dir: Path, rows: Iterable[Mapping[str, Any]], meta: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write results.json (rows + run metadata + column notes) and results.csv; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sort_rows(rows)
    doc = {"schema": SCHEMA, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta, "columns": COLUMNS, "notes": NOTES, "rows": rows}
    json_path, csv_path = out_dir / "results.json", out_dir / "results.csv"
    _atomic_write(json_path, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    tmp = csv_path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({c: "" if row.get(c) is None else row[c] for c in COLUMNS})
    tmp.replace(csv_path)
    return json_path, csv_path


def read_results(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python -m bench sweep --out {out_dir}` first")
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r}, this version reads {SCHEMA}")
    return doc


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
