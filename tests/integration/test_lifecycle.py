"""Ctrl-C of `make serve` ends every process it started (vLLM engines included) and
frees every port, so an immediate second start works."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.app_process import BASE_URL, AppProcess, busy_ports

CONFIG = "configs/local-cpu.yaml"


@pytest.mark.slow
def test_ctrl_c_ends_everything_and_an_immediate_restart_works(log_dir):
    for start in ("first", "second"):
        assert not busy_ports(), f"ports {busy_ports()} busy before the {start} start"
        app = AppProcess(CONFIG, log_dir, via_make=True).start()
        try:
            app.wait_ready()
            r = httpx.post(f"{BASE_URL}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4}, timeout=120)
            assert r.status_code == 200, r.text
            engines = [p for p in app.leftovers() if "VLLM" in p]
            assert len(engines) >= 4, f"expected 2 EngineCore + 2 Worker processes, saw {engines}"
        finally:
            app.interrupt()
        assert app.leftovers() == [], f"processes survived Ctrl-C after the {start} start:\n{app.log_tail()}"
        assert busy_ports() == [], f"ports still bound after the {start} start"
