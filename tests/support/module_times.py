"""A pytest plugin: the wall time of each test module (setup, calls and teardown of its tests,
module fixtures included), printed at the end of the run and written to ``$MODULE_TIMES_FILE``
(CSV) when set. The suite's budget is spent per module; this is how it is published
(docs/testing.md, "Time by module")."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

_seconds: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)
_started = time.monotonic()


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::", 1)[0]
    _seconds[module] += report.duration
    if report.when == "call":
        _tests[module] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not _seconds:
        return
    rows = sorted(_seconds.items(), key=lambda kv: -kv[1])
    terminalreporter.section("time by module")
    for module, seconds in rows:
        terminalreporter.write_line(f"{seconds / 60:7.1f} min  {_tests[module]:4d} tests  {module}")
    terminalreporter.write_line(f"{(time.monotonic() - _started) / 60:7.1f} min  in all (wall)")
    if path := os.environ.get("MODULE_TIMES_FILE"):
        lines = ["module,tests,seconds"] + [f"{m},{_tests[m]},{s:.1f}" for m, s in rows]
        Path(path).write_text("\n".join(lines) + "\n")
