"""Ctrl-C of `make serve` ends every process it started (vLLM engines included) and
frees every port, so an immediate second start works."""

from __future__ import annotations

import time

import httpx
import pytest

from app.procs import BASE_URL, AppProcess, busy_ports, kill_run


def port_holders() -> str:
    import subprocess

    return subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout

CONFIG = "configs/local-cpu.yaml"


@pytest.mark.slow
def test_ctrl_c_ends_everything_and_an_immediate_restart_works(log_dir):
    for start in ("first", "second"):
        assert not busy_ports(), f"ports {busy_ports()} busy before the {start} start"
        app = AppProcess(CONFIG, log_dir, how="make").start()
        try:
            app.wait_ready()
            r = httpx.post(f"{BASE_URL}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4}, timeout=120)
            assert r.status_code == 200, r.text
            engines = [p for p in app.leftovers() if "VLLM" in p]
            assert len(engines) >= 4, f"expected 2 EngineCore + 2 Worker processes, saw {engines}"
        finally:
            code = app.interrupt()
        # `make serve` returns only once app.run has swept the run's processes.
        assert app.leftovers() == [], f"processes survived Ctrl-C after the {start} start (exit {code}):\n{app.log_tail()}"
        assert busy_ports() == [], f"ports {busy_ports()} still bound after the {start} start: {port_holders()}"


@pytest.mark.slow
def test_ctrl_c_of_plain_serve_run_leaves_no_engine_behind(log_dir):
    """Without our wrapper, vLLM engines used to outlive their replicas; the connector
    ties them to their parent, so Serve's own shutdown is enough."""
    assert not busy_ports()
    app = AppProcess(CONFIG, log_dir, how="serve").start()
    try:
        app.wait_ready()
    finally:
        app.interrupt()
    deadline = time.monotonic() + 60
    while app.leftovers() and time.monotonic() < deadline:
        time.sleep(2)
    engines = [p for p in app.leftovers() if "VLLM" in p]
    assert engines == [], f"engines outlived `serve run`: {engines}\n{app.log_tail()}"
    assert busy_ports() == [], "ports still bound after `serve run` ended"
    kill_run(app.run_id)  # anything else of Ray's that lingers is not what this test is about
