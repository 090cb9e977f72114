"""Integration fixtures of the whole session: no engine outlives the tests, every app exports its metrics every
2 s, one log directory, and the reference engine. Each module starts its own app (``make serve``, ``serve run``,
``python -m app.tools.run``; tests/integration/apps.py) and ends it with Ctrl-C."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from app.tools.procs import orphaned_engines
from bench.engine_metrics import EXPORT_INTERVAL_ENV, SERVE_STATUS_GAUGE_ENV
from bench.reference import ReferenceServer
from tests.integration.reference import ReferenceEngine

REFERENCE_CONFIG = "configs/local-cpu.yaml"
# The apps of the tests export their metrics every second (Ray's floor) instead of every 10 s (Ray settings an
# operator can make too; bench.engine_metrics says why Serve's status gauges go with it): the tests wait for
# metrics to settle about a hundred times, each an export interval and a margin. From 2 s to 1: a third less
# waiting in test_pull.py (75 -> 53 s, same hour, 2026-12-06).
TEST_METRICS_ENV = {EXPORT_INTERVAL_ENV: "1000", SERVE_STATUS_GAUGE_ENV: "0.5"}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def no_engine_outlives_the_tests():
    assert not orphaned_engines(), f"orphaned vLLM engines before the tests: {orphaned_engines()} (make clean-procs)"
    yield
    # An engine whose replica was killed gets SIGTERM (PR_SET_PDEATHSIG) and takes a few
    # seconds to shut down, re-parented to init meanwhile: orphaned for good only after that.
    deadline = time.monotonic() + 30
    while orphaned_engines() and time.monotonic() < deadline:
        time.sleep(1)
    assert not orphaned_engines(), f"vLLM engines outlived the tests: {orphaned_engines()}"


@pytest.fixture(scope="session", autouse=True)
def apps_export_metrics_every_second():
    """Every app, cluster node and metrics reader of the session sees the same intervals (its environment)."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in TEST_METRICS_ENV.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("app-logs")


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    # Its engine's ZeroMQ IPC sockets in the session's temporary directory, not left in /tmp.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("reference-rpc")))
        engine = ReferenceEngine(REFERENCE_CONFIG)
    yield engine
    engine.close()


@pytest.fixture
def vllm_server(tmp_path_factory):
    """``vllm serve`` with the app's decode engine args (bench.reference), for the parity checks only: up for the
    test that asks it (an engine more on the box for the whole session slowed the cluster drills' restarts)."""
    server = ReferenceServer(REFERENCE_CONFIG, tmp_path_factory.mktemp("vllm-serve"))  # short: vLLM's IPC paths
    yield server
    server.close()
