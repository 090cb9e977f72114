"""``python -m bench identity-cost``: what KV identity (connector.kv_identity) costs a request, by prompt length.

Each side digests the prompt's token ids once a request (prefill when its leg finishes, decode before it plans its
READ or registers its blocks), from the Python list vLLM holds. The figure is the median of repeated digests of a
list of that many random ids on this machine, on one thread, with nothing else running."""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from pathlib import Path

from connector.kv_identity import identity_of

LENGTHS = (256, 1024, 4096, 16384, 131072)


def measure(lengths=LENGTHS, repeats: int = 50) -> list[dict]:
    rows = []
    for tokens in lengths:
        ids = [random.randrange(49152) for _ in range(tokens)]
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            identity_of(ids)
            times.append(time.perf_counter() - started)
        rows.append({"prompt_tokens": tokens, "median_ms": round(statistics.median(times) * 1e3, 4),
                     "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 4)})
    return rows


def run_identity_cost(out: Path) -> list[dict]:
    rows = measure()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"taken": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
                               "per_side_per_request": rows}, indent=1))
    return rows
