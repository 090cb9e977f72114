"""Ctrl-C of `make serve` ends every process it started (vLLM engines included) and
frees every port, so an immediate second start works; a plain `serve run` leaves no
engine behind either."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest

from app.procs import BASE_URL, AppProcess, busy_ports, kill_run

CONFIG = "configs/local-cpu.yaml"


def port_holders() -> str:
    return subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout


def _start_and_serve(app: AppProcess) -> None:
    app.wait_ready()
    r = httpx.post(f"{BASE_URL}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4}, timeout=120)
    assert r.status_code == 200, r.text
    engines = [p for p in app.leftovers() if "VLLM" in p]
    assert len(engines) >= 4, f"expected 2 EngineCore + 2 Worker processes, saw {engines}"


@pytest.mark.slow
def test_ctrl_c_ends_everything_and_an_immediate_restart_works(log_dir):
    assert not busy_ports(), f"ports {busy_ports()} busy before the first start"
    app = AppProcess(CONFIG, log_dir, how="make").start()
    try:
        _start_and_serve(app)
    finally:
        code = app.interrupt()
    # `make serve` returns only once app.run has swept the run's processes.
    assert app.leftovers() == [], f"processes survived Ctrl-C of make serve (exit {code}):\n{app.log_tail()}"
    assert busy_ports() == [], f"ports {busy_ports()} still bound after make serve ended: {port_holders()}"

    # The immediate restart, as plain `serve run` inside the venv. Without our wrapper's
    # sweep, vLLM engines used to outlive their replicas; the connector ties them to
    # their parent, so Serve's own shutdown is enough.
    app = AppProcess(CONFIG, log_dir, how="serve").start()
    try:
        _start_and_serve(app)
    finally:
        app.interrupt()
    deadline = time.monotonic() + 60
    while [p for p in app.leftovers() if "VLLM" in p] and time.monotonic() < deadline:
        time.sleep(2)
    engines = [p for p in app.leftovers() if "VLLM" in p]
    assert engines == [], f"engines outlived `serve run`: {engines}\n{app.log_tail()}"
    assert busy_ports() == [], "ports still bound after `serve run` ended"
    kill_run(app.run_id)  # anything else of Ray's that lingers is not what this test is about
