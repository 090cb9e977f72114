"""The text of a Prometheus endpoint, only the lines of some metrics. Ray's endpoint is over a megabyte (its own
histograms) and prometheus_client takes a quarter second of CPU to parse it whole; the readers that poll it (the
drill through an outage, bench.engine_metrics for the tests and benchmarks) pick out their lines first."""

from __future__ import annotations

import httpx


def metric_lines(url: str, *names: str, timeout_s: float = 10) -> str:
    """The endpoint's text; with ``names``, only the lines that start with one of them (a name is a prefix: a
    histogram's ``_bucket``, ``_sum`` and ``_count`` lines come with it)."""
    text = httpx.get(url, timeout=timeout_s).text
    if names:
        text = "".join(line for line in text.splitlines(keepends=True) if line.startswith(names))
    return text
