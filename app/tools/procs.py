"""Find and end every process one app run started, engines included.

vLLM engine processes outlive ``ray stop --force`` and a Ctrl-C of ``serve run``
(re-parented to init, still holding NIXL side-channel ports), so we cannot rely on the
process tree. Instead each run exports a marker variable; every descendant — Ray's
raylet and workers, Serve replicas, vLLM EngineCore and workers — inherits it, and
``/proc/<pid>/environ`` tells us who belongs to the run. Listing processes, their names,
command lines, children and CPU times, and signalling them, is psutil's.

:class:`AppProcess` starts a run the way a user does (``python -m app.tools.run CONFIG``, what
``make serve`` runs) in its own process group; the integration tests and the benchmarks
(``python -m bench``) both start the app through it.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil

from app.ingress.proxy_gate import PROXY_ENV
from connector.port_check import is_free

MARKER = "RENDEZVOUS_RUN_ID"
REPO = Path(__file__).resolve().parents[2]
BASE_URL = "http://127.0.0.1:8000"
# Ports the local configs use: HTTP, and the first side channels of each role.
LOCAL_PORTS = (8000, 20000, 20001, 22000, 22001)
RAY_SESSION = Path("/tmp/ray/session_latest")  # the local Ray cluster's session (ports, logs)


def new_run_env(base: dict[str, str] | None = None, *, keep_existing: bool = False) -> dict[str, str]:
    """``base`` (default: this process's environment) with a run marker; with
    ``keep_existing`` an inherited marker is kept, so a caller can track the run. Ray started
    with it installs ``app.ingress.proxy_gate`` in every Serve proxy (unless ``base`` says otherwise)."""
    env = dict(os.environ if base is None else base)
    env |= {k: v for k, v in PROXY_ENV.items() if k not in env}
    if not (keep_existing and env.get(MARKER)):
        env[MARKER] = uuid.uuid4().hex
    return env


def rpc_dir_prefix(run_id: str) -> str:
    """The name prefix of a run's directory for vLLM's IPC sockets (``app.tools.run`` makes and removes it)."""
    return f"rendezvous-rpc-{run_id[:8]}-"


def process_environ(pid: int) -> dict[str, str]:
    """``pid``'s initial environment ({} if it is gone). Read by hand, not with psutil's ``Process.environ()``:
    Ray's processes set their title (setproctitle), which overwrites the start of that block with NULs, and
    psutil stops reading at the first empty entry."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def process_name(pid: int) -> str:
    """The process's name as the kernel keeps it (/proc/<pid>/comm: at most 15 characters)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def find_processes(run_id: str | None) -> list[int]:
    """Pids carrying ``run_id`` (any run's, if None), excluding this process and its
    ancestors: the ``make serve`` that started ``app.tools.run`` carries the marker too, and
    the sweep must not kill it (it exits on its own once ``app.tools.run`` has)."""
    me = psutil.Process()
    skip = {me.pid} | {p.pid for p in me.parents() if p.pid > 1}
    pids = []
    for pid in psutil.pids():
        if pid not in skip and (marker := process_environ(pid).get(MARKER)) is not None and (run_id is None or marker == run_id):
            pids.append(pid)
    return pids


def _is_engine(name: str | None) -> bool:
    """vLLM names its processes ``VLLM::EngineCore``, ``VLLM::Worker``…"""
    return (name or "").startswith("VLLM::")


def orphaned_engines() -> list[int]:
    """vLLM engine processes (``VLLM::EngineCore``, ``VLLM::Worker``) whose parent died. Not zombies: an engine
    that already exited and waits for init to reap it holds nothing."""
    return [p.pid for p in psutil.process_iter(["name", "ppid", "status"])
            if _is_engine(p.info["name"]) and p.info["ppid"] == 1 and p.info["status"] != psutil.STATUS_ZOMBIE]


def engine_processes(deployment: str) -> list[int]:
    """vLLM engine processes (EngineCore and its workers) under the Serve replicas whose
    deployment name starts with ``deployment`` (e.g. ``Prefill``) — for fault injection."""
    replica = re.compile(rf"ray::ServeReplica:[^:]+:{re.escape(deployment)}")
    engines = set()
    for proc in psutil.process_iter(["cmdline"]):
        if replica.match(_joined(proc.info["cmdline"])):
            with contextlib.suppress(psutil.Error):  # the replica (or a child) is gone
                engines |= {child.pid for child in proc.children(recursive=True) if _is_engine(_name(child))}
    return sorted(engines)


def _name(proc: psutil.Process) -> str | None:
    try:
        return proc.name()
    except psutil.Error:
        return None


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds the live processes among ``pids`` have used so far."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


# What SIGTERM buys: vLLM's engines shut down on it (their side-channel ports and shared memory freed), so they get
# the whole grace. Ray's daemons do not: its raylet takes 10 s on SIGTERM and its GCS ignores it (Ray 2.60), and a
# Serve replica SIGKILLed takes its engines along (PR_SET_PDEATHSIG, connector.vllm_connectors). So the rest get
# this: a cluster's Ctrl-C took 30 s, two whole graces of it spent waiting for Ray's daemons.
OTHERS_GRACE_S = 1.0


def kill_run(run_id: str | None, grace_s: float = 10.0) -> list[int]:
    """SIGTERM the run's processes, SIGKILL what is left after its grace (``kill``)."""
    return kill(find_processes(run_id), grace_s)


def kill(pids: list[int], grace_s: float = 10.0) -> list[int]:
    """SIGTERM ``pids``, SIGKILL what is left after its grace: ``grace_s`` for a vLLM engine, at most
    ``OTHERS_GRACE_S`` for any other process; return survivors. A zombie counts as ended (its parent may never
    reap it). psutil refuses to signal a pid that was reused by a new process meanwhile."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    graces = {proc.pid: grace_s if _is_engine(_name(proc)) else min(grace_s, OTHERS_GRACE_S) for proc in procs}
    _signal(procs, signal.SIGTERM)
    started, killed, last_kill = time.monotonic(), set(), None
    while procs := [p for p in procs if _alive(p)]:
        now = time.monotonic()
        if due := [p for p in procs if p.pid not in killed and now - started >= graces[p.pid]]:
            _signal(due, signal.SIGKILL)
            killed |= {p.pid for p in due}
            last_kill = now
        if all(p.pid in killed for p in procs) and now - last_kill > 5.0:
            break  # survived SIGKILL (stuck in the kernel): the caller reports it
        time.sleep(0.2)
    return [p.pid for p in procs]


def _signal(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied as e:  # as os.kill would raise it
            raise PermissionError(f"not allowed to signal pid {proc.pid}") from e


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (a zombie is gone but for its parent's reaping)."""
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if _alive(psutil.Process(pid)):
                alive.append(pid)
    return alive


class AppProcess:
    """``python -m app.tools.run CONFIG`` (what ``make serve`` runs), or ``make serve`` itself,
    in its own process group."""

    def __init__(self, config: str, log_dir: Path, *, how: str = "app.tools.run", base_url: str = BASE_URL,
                 env: dict[str, str] | None = None, args: list[str] | None = None):
        self.config = config
        self.how = how
        self.base_url = base_url
        self.command = {
            "app.tools.run": [sys.executable, "-m", "app.tools.run", config],
            "make": ["make", "--no-print-directory", "serve", f"CONFIG={config}"],
            # Plain `serve run` inside the venv, without our wrapper's clean-up sweep.
            "serve": [str(Path(sys.executable).with_name("serve")), "run", config],
            # A three-node cluster on this machine serving it (app.tools.cluster; root).
            "cluster": [sys.executable, "-m", "app.tools.cluster", "up", config],
        }[how] + list(args or [])  # args: the command's own options (the cluster's --link-mbit)
        self.env = {**new_run_env(), **(env or {})}  # env: extra variables for every process of the run
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
        """Until ``/ready`` answers 200 (the disaggregated app; ``/v1/models`` where there is
        no ``/ready``: the aggregated baseline), then one tiny request proves the path.
        ``readiness_seen`` keeps the statuses ``/ready`` gave on the way, in order; ``readiness_unanswered``
        the seconds (since the wait began) of each poll after the first answer that got none within 5 s."""
        self.readiness_seen: list[int] = []
        self.readiness_unanswered: list[float] = []
        started = time.monotonic()
        deadline = started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"app exited with {self.proc.returncode} before ready:\n{self.log_tail()}")
            # app.tools.run (and make serve) stop on a failed deploy themselves; plain serve run waits on, serving nothing.
            if self.how == "serve" and (failed := read_deploy_failure()) is not None:
                raise RuntimeError(f"{failed}\n{self.log_tail()}")
            try:
                status = (read_readiness(f"{self.base_url}/ready") or (None,))[0]
                if status is not None and (not self.readiness_seen or self.readiness_seen[-1] != status):
                    self.readiness_seen.append(status)
                elif status is None and self.readiness_seen:
                    self.readiness_unanswered.append(round(time.monotonic() - started, 1))
                if status is None:  # no readiness route (yet, or at all): models are listed before replicas are up
                    status = _http_status(f"{self.base_url}/v1/models", timeout=5)
                if status == 200:
                    body = {"prompt": "Hi", "max_tokens": 1}
                    if _http_status(f"{self.base_url}/v1/completions", body=body, timeout=120) == 200:
                        return
            except (OSError, http.client.HTTPException):  # refused, reset, timed out, cut short
                pass
            time.sleep(1)
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
    """Which of ``ports`` a listener could not bind now (leftovers of a run, before or after it)."""
    return [port for port in ports if not is_free(port)]


def _http(url: str, *, body: dict | None = None, timeout: float, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Status and body of a GET (or, with ``body``, a JSON POST); HTTP errors are answers too."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _http_status(url: str, *, body: dict | None = None, timeout: float) -> int:
    return _http(url, body=body, timeout=timeout)[0]


def base_url_of(config: dict) -> str:
    """Where a serve config's HTTP proxy answers on this host (Serve's defaults where it says nothing)."""
    http = config.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{http.get('port', 8000)}"


def read_readiness(url: str) -> tuple[int, dict] | None:
    """Status (200 or 503) and body of the app's readiness route (``app.ingress.readiness``), or
    None while it is not ours that answers (Serve's proxy before the ingress is up, an app
    without ``/ready``, nothing listening)."""
    try:
        status, raw = _http(url, timeout=5)
        body = json.loads(raw)
    except (OSError, http.client.HTTPException, ValueError):
        return None
    return (status, body) if status in (200, 503) and isinstance(body, dict) and "ready" in body else None


# Where the Ray that ``serve run`` starts serves its dashboard, and with it Serve's REST API (Ray's default port).
DASHBOARD_URL = "http://127.0.0.1:8265"


def deploy_failure(details: dict) -> str | None:
    """Why Serve gave up on an application (status DEPLOY_FAILED: its code did not import or build, or its
    replicas failed to start again and again), from the dashboard's ``/api/serve/applications/``
    (Serve's ``ServeInstanceDetails``); None while every application deploys or runs."""
    for name, app in sorted((details.get("applications") or {}).items()):
        if isinstance(app, dict) and app.get("status") == "DEPLOY_FAILED":
            message = str(app.get("message") or "").strip().splitlines()
            return f"Serve could not deploy application {name!r}: " + "\n".join(message[-12:])
    return None


def ray_auth_headers(env: dict[str, str] | None = None) -> dict[str, str]:
    """The bearer token Ray's dashboard asks for (Ray 2.59 turns token authentication on for local clusters), from
    where Ray's token authentication docs say a client finds it: ``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH``
    names, or ``~/.ray/auth_token``; none where there is no token."""
    env = os.environ if env is None else env
    token = env.get("RAY_AUTH_TOKEN", "")
    if not token:
        path = Path(env["RAY_AUTH_TOKEN_PATH"]) if env.get("RAY_AUTH_TOKEN_PATH") else Path.home() / ".ray" / "auth_token"
        try:
            token = path.read_text().strip()
        except OSError:
            return {}
    return {"Authorization": f"Bearer {token}"} if token else {}


def serve_details(dashboard_url: str = DASHBOARD_URL, env: dict[str, str] | None = None,
                  timeout_s: float = 5) -> dict | None:
    """Serve's ``ServeInstanceDetails`` from the dashboard behind ``dashboard_url``, asked with the Ray token ``env``
    points to (default: this process's); None while it cannot be asked."""
    try:
        status, raw = _http(f"{dashboard_url}/api/serve/applications/", timeout=timeout_s, headers=ray_auth_headers(env))
        details = json.loads(raw) if status == 200 else {}
    except (OSError, http.client.HTTPException, ValueError):
        return None
    return details if isinstance(details, dict) else None


def read_deploy_failure(dashboard_url: str = DASHBOARD_URL) -> str | None:
    """``deploy_failure`` of the Serve instance behind ``dashboard_url``; None while it cannot be asked."""
    details = serve_details(dashboard_url)
    return deploy_failure(details) if details is not None else None


def _joined(cmdline: list[str] | None) -> str:
    """A command line as one string (a process that set its title may keep NULs in it)."""
    return " ".join(cmdline or []).replace("\0", " ").strip()[:200]


def _cmdline(pid: int) -> str:
    try:
        return _joined(psutil.Process(pid).cmdline())
    except psutil.ZombieProcess:
        return ""  # what /proc/<pid>/cmdline holds for a zombie
    except psutil.Error:
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
