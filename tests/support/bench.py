"""Synthetic bench data shared by the bench tests (tests/unit/bench/): vLLM benchmark results,
result rows and engine-metric snapshots, as the bench's modules read them."""

from __future__ import annotations

from bench.results import Transfers, make_row

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def vllm_result(completed=4, failed=0, ttft=100.0, tpot=20.0, **extra) -> dict:
    """The shape of vllm.benchmarks.serve.main's result (the keys we read)."""
    result = {
        "num_prompts": completed + failed,
        "completed": completed,
        "failed": failed,
        "duration": 12.5,
        "request_throughput": completed / 12.5,
        "output_throughput": completed * 32 / 12.5,
        "total_token_throughput": completed * (256 + 32) / 12.5,
        "total_input_tokens": completed * 256,
    }
    for metric, base in (("ttft", ttft), ("tpot", tpot), ("itl", tpot), ("e2el", ttft + 31 * tpot)):
        result[f"mean_{metric}_ms"] = base * 1.1
        for p, factor in ((50, 1.0), (90, 1.5), (99, 2.0)):
            result[f"p{p}_{metric}_ms"] = base * factor
    return {**result, **extra}


def synthetic_rows() -> list[dict]:
    rows = []
    for mode, slow in (("push", 1.0), ("pull", 1.4), ("aggregated", 0.9)):
        for input_len in (256, 1024):
            for rate in (0.1, 0.25):
                transfers = None if mode == "aggregated" else Transfers(4, 0, 4e6, 6e6, 8e6, 0.004, True)
                result = vllm_result(ttft=slow * input_len * (1 + rate), tpot=slow * 20 * (1 + rate))
                rows.append(make_row(mode, input_len, rate, 32, result, transfers))
    return rows


def snap(transfers=0, buckets=None, failed=0, replica_copy=True) -> dict:
    """A RoleMetrics snapshot: push records transfers on prefill; per-replica entries repeat them."""
    role = {"nixl_xfer_time_seconds_count": float(transfers), "nixl_num_failed_transfers_total": float(failed)}
    for le, count in (buckets or {}).items():
        role[f"nixl_bytes_transferred_bucket[le={le}]"] = float(count)
    out = {"prefill": role, "decode": {"request_success_total": float(transfers)}}
    if replica_copy:
        out["replica:abc"] = dict(role)
    return out
