"""Find and end every process one app run started, engines included.

vLLM engine processes outlive ``ray stop --force`` and a Ctrl-C of ``serve run``
(re-parented to init, still holding NIXL side-channel ports), so we cannot rely on the
process tree. Instead each run exports a marker variable; every descendant — Ray's
raylet and workers, Serve replicas, vLLM EngineCore and workers — inherits it, and
``/proc/<pid>/environ`` tells us who belongs to the run.

:class:`AppProcess` starts a run the way a user does (``python -m app.run CONFIG``, what
``make serve`` runs) in its own process group; the integration tests and the benchmarks
(``python -m bench``) both start the app through it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

MARKER = "RENDEZVOUS_RUN_ID"
REPO = Path(__file__).resolve().parents[1]
BASE_URL = "http://127.0.0.1:8000"
# Ports the local configs use: HTTP, and the first side channels of each role.
LOCAL_PORTS = (8000, 20000, 20001, 22000, 22001)
RAY_SESSION = Path("/tmp/ray/session_latest")  # the local Ray cluster's session (ports, logs)


def new_run_env(base: dict[str, str] | None = None, *, keep_existing: bool = False) -> dict[str, str]:
    """``base`` (default: this process's environment) with a run marker; with
    ``keep_existing`` an inherited marker is kept, so a caller can track the run."""
    env = dict(os.environ if base is None else base)
    if not (keep_existing and env.get(MARKER)):
        env[MARKER] = uuid.uuid4().hex
    return env


def _marker_of(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(MARKER.encode() + b"="):
            return item.split(b"=", 1)[1].decode()
    return None


def find_processes(run_id: str | None) -> list[int]:
    """Pids carrying ``run_id`` (any run's, if None), excluding this process and its
    ancestors: the ``make serve`` that started ``app.run`` carries the marker too, and
    the sweep must not kill it (it exits on its own once ``app.run`` has)."""
    skip = _ancestry(os.getpid())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        marker = _marker_of(int(entry.name))
        if marker is not None and (run_id is None or marker == run_id):
            pids.append(int(entry.name))
    return pids


def _stat(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) of ``pid``, or None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], int(stat.rsplit(")", 1)[1].split()[1])


def _ancestry(pid: int) -> set[int]:
    """``pid`` and its ancestors."""
    chain = set()
    while pid > 1 and pid not in chain:
        chain.add(pid)
        stat = _stat(pid)
        pid = stat[1] if stat is not None else 1
    return chain


def _all_stats() -> dict[int, tuple[str, int]]:
    """(comm, ppid) of every process."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    return stats


def orphaned_engines() -> list[int]:
    """vLLM engine processes (``VLLM::EngineCore``, ``VLLM::Worker``) whose parent died."""
    return [pid for pid, (comm, ppid) in _all_stats().items() if comm.startswith("VLLM::") and ppid == 1]


def engine_processes(deployment: str) -> list[int]:
    """vLLM engine processes (EngineCore and its workers) under the Serve replicas whose
    deployment name starts with ``deployment`` (e.g. ``Prefill``) — for fault injection."""
    stats = _all_stats()
    replicas = {pid for pid in stats if re.match(rf"ray::ServeReplica:[^:]+:{re.escape(deployment)}", _cmdline(pid))}

    def under_a_replica(pid: int) -> bool:
        while pid > 1:
            pid = stats.get(pid, ("", 1))[1]
            if pid in replicas:
                return True
        return False

    return sorted(pid for pid, (comm, _) in stats.items() if comm.startswith("VLLM::") and under_a_replica(pid))


def kill_run(run_id: str | None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the run's processes, SIGKILL what is left after ``grace_s``."""
    return kill(find_processes(run_id), grace_s)


def kill(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``pids``, SIGKILL what is left after ``grace_s``; return survivors."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return []
            time.sleep(0.2)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class AppProcess:
    """``python -m app.run CONFIG`` (what ``make serve`` runs), or ``make serve`` itself,
    in its own process group."""

    def __init__(self, config: str, log_dir: Path, *, how: str = "app.run", base_url: str = BASE_URL):
        self.config = config
        self.base_url = base_url
        self.command = {
            "app.run": [sys.executable, "-m", "app.run", config],
            "make": ["make", "--no-print-directory", "serve", f"CONFIG={config}"],
            # Plain `serve run` inside the venv, without our wrapper's clean-up sweep.
            "serve": [str(Path(sys.executable).with_name("serve")), "run", config],
        }[how]
        self.env = new_run_env()
        self.run_id = self.env[MARKER]
        self.log_path = Path(log_dir) / f"{Path(config).stem}-{self.run_id[:8]}.log"
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
            preexec_fn=_default_sigint,
        )
        return self

    def wait_ready(self, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode} before ready:\n{self.log_tail()}")
            try:
                if _http_status(f"{self.base_url}/v1/models", timeout=5) == 200:
                    # Models are listed before every replica is up; one tiny request proves the path.
                    body = {"prompt": "Hi", "max_tokens": 1}
                    if _http_status(f"{self.base_url}/v1/completions", body=body, timeout=120) == 200:
                        return
            except (OSError, http.client.HTTPException):  # refused, reset, timed out, cut short
                pass
            time.sleep(3)
        raise TimeoutError(f"app not ready after {timeout_s} s:\n{self.log_tail()}")

    def interrupt(self, timeout_s: float = 180) -> int:
        """Ctrl-C, as a terminal sends it: SIGINT to the whole foreground process group;
        returns once the command has exited and, within ``timeout_s``, every process of
        the run is gone (what is left then is for the caller to report)."""
        deadline = time.monotonic() + timeout_s
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            kill_run(self.run_id)  # serve run has a session of its own: the group kill missed it
            raise
        while find_processes(self.run_id) and time.monotonic() < deadline:
            time.sleep(1)
        return code

    def leftovers(self) -> list[str]:
        return [f"{pid} {_cmdline(pid)}" for pid in find_processes(self.run_id)]

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def metrics_url(self) -> str:
        """Ray's Prometheus export on this node (vLLM engine metrics carry ``ray_vllm_``)."""
        port = next(RAY_SESSION.glob("metrics_export_port_*")).read_text().strip()
        return f"http://127.0.0.1:{port}/metrics"


def _default_sigint() -> None:
    """Children started from a background shell inherit SIGINT as *ignored*, and Python
    then never raises KeyboardInterrupt: serve run would sleep through Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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


def _http_status(url: str, *, body: dict | None = None, timeout: float) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kill", action="store_true", help="end them (SIGTERM, then SIGKILL)")
    parser.add_argument("--run-id", help="only this run's processes (default: every run's, and orphaned engines)")
    args = parser.parse_args()
    pids = find_processes(args.run_id)
    if args.run_id is None:  # also engines a plain `serve run` or `ray stop` left behind
        pids = sorted(set(pids) | set(orphaned_engines()))
    print(f"{len(pids)} process(es): {pids}")
    if args.kill and pids:
        left = kill(pids)
        print("all ended" if not left else f"still alive: {left}")


if __name__ == "__main__":
    main()
