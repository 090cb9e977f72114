"""A pytest plugin: the wall time of each test module (setup, calls and teardown of its tests,
module fixtures included), and how much of it went to waiting for Ray's metric exports
(``bench.engine_metrics.settle`` and ``wait_for``), and how busy the box's cores were meanwhile (the share of
all cores' time not idle: what is left for running modules side by side), printed at the end of the run and
written to ``$MODULE_TIMES_FILE`` (CSV) when set; with ``$TEST_TIMES_FILE`` set, each test's setup, call and
teardown too, with the cores busy meanwhile (where the idle core is). The suite's budget is spent per module;
this is how it is published (docs/testing.md, "Time by module")."""

from __future__ import annotations

import csv
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)
_metric_waits: dict[str, float] = defaultdict(float)
_busy_s: dict[str, float] = defaultdict(float)
_span_s: dict[str, float] = defaultdict(float)  # wall time between reports, the CPU share's denominator
_waited_before = 0.0
_clock = time.monotonic  # bound now: unit tests patch time.monotonic with fake clocks
_started = _clock()
_CORES = psutil.cpu_count() or 1


def _busy_now() -> float:
    """CPU seconds the box's cores spent not idle since boot (all processes, not just the tests')."""
    times = psutil.cpu_times()
    # Linux counts guest time inside user and nice already.
    not_busy = ("idle", "iowait", "guest", "guest_nice")
    return sum(times) - sum(getattr(times, name, 0.0) for name in not_busy)


_mark = (_clock(), _busy_now())


def pytest_collection_finish(session) -> None:
    global _mark
    _mark = (_clock(), _busy_now())  # collection's CPU is no module's


class _PerTest:
    """Rows of ``$TEST_TIMES_FILE``, flushed as they come (a suite cut short keeps what ran)."""

    def __init__(self, path: str):
        self.file = open(path, "w", newline="")  # open for the whole session
        self.csv = csv.writer(self.file)
        self.writerow(["test", "phase", "seconds", "busy_cores"])

    def writerow(self, row: list[str]) -> None:
        self.csv.writerow(row)
        self.file.flush()


_per_test = _PerTest(os.environ["TEST_TIMES_FILE"]) if os.environ.get("TEST_TIMES_FILE") else None


def _waited_s() -> float:
    metrics = sys.modules.get("bench.engine_metrics")  # imported by the tests that wait for metrics
    return metrics.waited_s if metrics is not None else 0.0


def pytest_runtest_logreport(report) -> None:
    global _waited_before, _mark
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    now = (_clock(), _busy_now())
    span_s, busy_s = now[0] - _mark[0], now[1] - _mark[1]
    _span_s[module] += span_s
    _busy_s[module] += busy_s
    _mark = now
    if _per_test is not None:
        _per_test.writerow([report.nodeid, report.when, f"{span_s:.1f}", f"{busy_s / span_s if span_s > 0 else 0.0:.2f}"])
    waited = _waited_s()
    _metric_waits[module] += waited - _waited_before
    _waited_before = waited
    if report.when == "call":
        _tests[module] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    rows = sorted(_seconds.items(), key=lambda kv: -kv[1])
    terminalreporter.section("time by module")
    for module, seconds in rows:
        terminalreporter.write_line(f"{seconds / 60:7.1f} min  {_tests[module]:4d} tests  "
                                    f"{_metric_waits[module] / 60:5.1f} min metric waits  {_cpu_busy(module):4.0%} CPU busy  {module}")
    busy, span = sum(_busy_s.values()), sum(_span_s.values())
    terminalreporter.write_line(f"{(_clock() - _started) / 60:7.1f} min  in all (wall); the cores "
                                f"{busy / (_CORES * span) if span > 0 else 0.0:.0%} busy while the tests ran")
    if path := os.environ.get("MODULE_TIMES_FILE"):
        lines = ["module,tests,seconds,metric_wait_seconds,cpu_busy"] + [
            f"{m},{_tests[m]},{s:.1f},{_metric_waits[m]:.1f},{_cpu_busy(m):.2f}" for m, s in rows]
        Path(path).write_text("\n".join(lines) + "\n")


def _cpu_busy(module: str) -> float:
    """Share of the cores' time busy while ``module`` ran (from the report before its first to its last)."""
    return max(0.0, _busy_s[module]) / (_CORES * _span_s[module]) if _span_s[module] > 0 else 0.0
