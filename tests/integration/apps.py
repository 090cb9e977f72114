"""What the integration modules share to start and talk to the real app: ``running_app`` starts a config as a
user would and checks that Ctrl-C left nothing; ``Client`` talks to its OpenAI endpoint and metrics;
``KvFaultSwitch`` is connector.faults' test-only switch for one app; ``EngineGauges`` watches the engines
go idle. The fixtures that use them are conftest's."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from app.tools.procs import BASE_URL, AppProcess, busy_ports, kill_run, rpc_dir_prefix
from bench.engine_metrics import RoleMetrics
from connector.faults import FAULT_FILE_ENV, FAULTS_ALLOWED_ENV


@contextlib.contextmanager
def running_app(config: str, log_dir: Path, how: str = "app.tools.run", env: dict[str, str] | None = None):
    """Start ``config`` as a user would (``how``: app.tools.run, ``make serve`` or plain ``serve
    run``) and end it with Ctrl-C. Every start first checks that the ports are free, and
    every end that Ctrl-C ended every process of the run and freed the ports, so the next
    module's start is the immediate restart a user would try."""
    busy = busy_ports()
    assert not busy, f"ports {busy} are taken before starting {config}: a previous run left processes (make clean-procs)"
    serve_rpc = None
    if how == "serve":  # plain `serve run` leaves vLLM's IPC sockets in /tmp; the tests' go where they are removed
        serve_rpc = Path(tempfile.mkdtemp(prefix="vllm-rpc-", dir=log_dir))
        env = {**(env or {}), "VLLM_RPC_BASE_PATH": str(serve_rpc)}
    app = AppProcess(config, log_dir, how=how, env=env).start()
    # app.tools.run gives vLLM's IPC sockets a directory of the run's own (plain `serve run` leaves them in /tmp).
    rpc_dirs = lambda: list(Path(tempfile.gettempdir()).glob(rpc_dir_prefix(app.run_id) + "*"))  # noqa: E731
    try:
        app.wait_ready()
        if how != "serve":
            assert [d for d in rpc_dirs() if any(d.iterdir())], f"{config}: no engine made its IPC sockets in the run's directory"
        yield app
    finally:
        code = app.interrupt()
        assert not rpc_dirs(), f"{config}: the run's IPC socket directory outlived it: {rpc_dirs()}"
        if how == "serve":
            # Plain `serve run` has no sweep of ours: the connector ties each engine to its
            # replica, so Serve's own shutdown must end the engines. Ray's own lingering
            # processes are not what this is about.
            deadline = time.monotonic() + 60
            while (engines := [p for p in app.leftovers() if "VLLM" in p]) and time.monotonic() < deadline:
                time.sleep(2)
            assert not engines, f"{config}: engines outlived `serve run`: {engines}\n{app.log_tail()}"
            kill_run(app.run_id)
            shutil.rmtree(serve_rpc, ignore_errors=True)
        left = app.leftovers()
        assert not left, f"{config}: processes survived Ctrl-C of {how}: {left}\n{app.log_tail()}"
        if FAULT_FILE_ENV not in (env or {}):  # no KV corrupted on purpose: no checksum may have failed
            false_alarms = [line[-200:] for line in app.log_path.open(errors="replace") if "landed wrong" in line]
            assert not false_alarms, f"{config}: KV checksums failed on clean traffic: {false_alarms}"
        assert code in (0, -2, 2, 130), f"{config}: exit code {code} after Ctrl-C of {how}\n{app.log_tail()}"
        assert not busy_ports(), f"{config}: ports {busy_ports()} still bound after {how} ended"


class Client:
    """Thin HTTP client for the app's OpenAI endpoint."""

    def __init__(self, app: AppProcess):
        self.app = app
        self.http = httpx.Client(base_url=BASE_URL, timeout=300)
        self.metrics = RoleMetrics(app.metrics_url())

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)


def with_args(config: str, log_dir: Path, name: str | None = None, **args) -> str:
    """``config`` with some app ``args`` replaced (e.g. a short retention for a test), as a new file
    (``name``.yaml, which also names the app's log; default ``<config>-test``)."""
    raw = yaml.safe_load(Path(config).read_text())
    raw["applications"][0]["args"].update(args)
    derived = log_dir / f"{name or Path(config).stem + '-test'}.yaml"
    derived.write_text(yaml.safe_dump(raw))
    return str(derived)


def app_client(config: str, log_dir: Path, how: str = "app.tools.run", switch: KvFaultSwitch | None = None):
    with running_app(config, log_dir, how, env=switch.env if switch else None) as app:
        client = Client(app) if switch is None else switch.attach(Client(app))
        yield client
        client.http.close()
        if switch is not None:
            switch.assert_only_injected_mismatches(client)


_LANDED_WRONG = re.compile(r"KV of (\S+) landed wrong")  # connector.kv_checksum's warning


class KvFaultSwitch:
    """connector.kv_checksum's test-only fault switch for one app: a file its engines read at each
    transfer (``client.kv_fault``), and a count of the faults a test injected (``kv_faults_injected``),
    against which the app log's mismatches are checked at the end: clean traffic raised no false alarm."""

    def __init__(self, path: Path):
        path.write_text("")
        self.path, self.env = path, {FAULT_FILE_ENV: str(path), FAULTS_ALLOWED_ENV: "1"}

    def attach(self, client: Client) -> Client:
        client.kv_fault, client.kv_faults_injected = self.path, 0
        # Requests, not lines: with decode TP > 1 every decode rank checks (and logs) its own share.
        client.kv_mismatches_logged = lambda: len({m.group(1) for line in client.app.log_path.open(errors="replace")
                                                   if (m := _LANDED_WRONG.search(line))})
        return client

    def assert_only_injected_mismatches(self, client: Client) -> None:
        # From the log: a replica's counters go with it, and some modules kill one.
        mismatches = client.kv_mismatches_logged()
        assert mismatches == client.kv_faults_injected, f"{mismatches} KV mismatches, {client.kv_faults_injected} injected"


IDLE_GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


class EngineGauges:
    """The latest value of ``IDLE_GAUGES`` each role's engines reported, polled in the background
    while the block runs. vLLM sets an engine's gauges at the end of each step, and Ray drops a
    gauge not set again within two exports: an engine that went idle stops reporting seconds later.
    So a check made after a step of a test must have been watching all along, and it keeps each
    role's latest value (a role that went idle early may have vanished before another one got there).

    An engine with requests in flight steps (a decode waiting for pushed KV every 0.25 s,
    connector.idle_wait), so it reports. One whose requests were all aborted mid-step reports
    nothing more: a role silent for ``SILENT_S`` while watched, longer than any step here, counts
    as idle whatever it last reported (what a silent engine holds, its gauges cannot show; its
    blocks held past a lease show in the app log, which the fuzz test reads)."""

    SILENT_S = 30.0

    def __init__(self, client, roles: tuple[str, ...]):
        self.client, self.roles = client, roles
        self.latest: dict[str, dict[str, float]] = {role: {} for role in roles}
        self.last_seen: dict[str, float] = {role: time.monotonic() for role in roles}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "EngineGauges":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                snap = self.client.metrics.snapshot(*IDLE_GAUGES)
            except httpx.HTTPError:
                continue
            for role in self.roles:
                reported = {key: snap[role][key] for key in IDLE_GAUGES if key in snap.get(role, {})}
                if reported:
                    self.latest[role].update(reported)
                    self.last_seen[role] = time.monotonic()

    def resumed(self, role: str) -> None:
        """``role``'s engines were stopped on purpose and run again: their silence counts from now."""
        self.last_seen[role] = time.monotonic()

    def kv_held_now(self) -> dict[str, float]:
        """Each role's KV in use right now (0 for a role not reporting): what a step of a test must give back
        is what it took on top of this. An earlier step can leave blocks held until their own deadline: a
        request registered with a prefill engine that was killed keeps its blocks until the registration's
        expiry, sized to the work that was queued (connector.push_deadline; docs/runbook.md)."""
        snap = self.client.metrics.snapshot("kv_cache_usage_perc")
        return {role: float(snap.get(role, {}).get("kv_cache_usage_perc", 0.0)) for role in self.roles}

    def wait_idle(self, timeout_s: float, kv_held_before: dict[str, float] | None = None) -> None:
        """Until every role's last report is no request and no more KV held than ``kv_held_before`` (none by
        default), or it stopped stepping."""
        deadline = time.monotonic() + timeout_s
        held = kv_held_before or {}

        def idle(role: str, values: dict[str, float]) -> bool:
            return (values.get("num_requests_running") == values.get("num_requests_waiting") == 0.0
                    and values.get("kv_cache_usage_perc", 1.0) <= held.get(role, 0.0))

        while True:
            busy = {role: dict(values) for role, values in self.latest.items()
                    if not idle(role, values) and time.monotonic() - self.last_seen[role] < self.SILENT_S}
            if not busy:
                return
            assert time.monotonic() < deadline, f"engines not idle after {timeout_s:g} s; last reported: {busy}"
            time.sleep(0.5)
