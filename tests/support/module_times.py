"""A pytest plugin: the wall time of each test module (setup, calls and teardown of its tests,
module fixtures included), and how much of it went to waiting for Ray's metric exports
(``bench.engine_metrics.settle`` and ``wait_for``), printed at the end of the run and written to
``$MODULE_TIMES_FILE`` (CSV) when set. The suite's budget is spent per module; this is how it is
published (docs/testing.md, "Time by module")."""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)
_metric_waits: dict[str, float] = defaultdict(float)
_waited_before = 0.0
_started = time.monotonic()


def _waited_s() -> float:
    metrics = sys.modules.get("bench.engine_metrics")  # imported by the tests that wait for metrics
    return metrics.waited_s if metrics is not None else 0.0


def pytest_runtest_logreport(report) -> None:
    global _waited_before
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
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
                                    f"{_metric_waits[module] / 60:5.1f} min metric waits  {module}")
    terminalreporter.write_line(f"{(time.monotonic() - _started) / 60:7.1f} min  in all (wall)")
    if path := os.environ.get("MODULE_TIMES_FILE"):
        lines = ["module,tests,seconds,metric_wait_seconds"] + [f"{m},{_tests[m]},{s:.1f},{_metric_waits[m]:.1f}" for m, s in rows]
        Path(path).write_text("\n".join(lines) + "\n")
