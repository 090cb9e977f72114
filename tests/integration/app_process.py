"""Start the real app the way a user does, and make sure everything it started ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.procs import MARKER, find_processes, new_run_env

REPO = Path(__file__).resolve().parents[2]
BASE_URL = "http://127.0.0.1:8000"
# Ports the local configs use: HTTP, and the first side channels of each role.
LOCAL_PORTS = (8000, 20000, 20001, 22000, 22001)


class AppProcess:
    """``python -m app.run CONFIG`` (what ``make serve`` runs), or ``make serve`` itself,
    in its own process group."""

    def __init__(self, config: str, log_dir: Path, *, via_make: bool = False):
        self.config = config
        self.command = (
            ["make", "--no-print-directory", "serve", f"CONFIG={config}"]
            if via_make
            else [sys.executable, "-m", "app.run", config]
        )
        self.env = new_run_env()
        self.run_id = self.env[MARKER]
        self.log_path = log_dir / f"{Path(config).stem}-{self.run_id[:8]}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "AppProcess":
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            self.command,
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, like a terminal job
        )
        return self

    def wait_ready(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode} before ready:\n{self.log_tail()}")
            try:
                if httpx.get(f"{BASE_URL}/v1/models", timeout=5).status_code == 200:
                    # Models are listed before every replica is up; one tiny request proves the path.
                    r = httpx.post(
                        f"{BASE_URL}/v1/completions",
                        json={"prompt": "Hi", "max_tokens": 1},
                        timeout=120,
                    )
                    if r.status_code == 200:
                        return
            except httpx.HTTPError:
                pass
            time.sleep(3)
        raise TimeoutError(f"app not ready after {timeout_s} s:\n{self.log_tail()}")

    def interrupt(self, timeout_s: float = 180) -> int:
        """Ctrl-C, as a terminal sends it: SIGINT to the whole foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def leftovers(self) -> list[str]:
        return [f"{pid} {_comm(pid)}" for pid in find_processes(self.run_id)]

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def metrics_url(self) -> str:
        session = Path("/tmp/ray/session_latest")
        port = next(session.glob("metrics_export_port_*")).read_text().strip()
        return f"http://127.0.0.1:{port}/metrics"


def busy_ports(ports=LOCAL_PORTS) -> list[int]:
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                busy.append(port)
    return busy


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
