"""``make serve``: run ``serve run CONFIG`` in the foreground, say when the app can answer
(and how far it got until then), and, however it ends (Ctrl-C, SIGTERM, crash), end every
process it started before returning. If a port the config needs is taken on this host
(another app running), refuse at once, naming the holder (``app.tools.preflight``)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

from app.ingress.readiness import GAVE_UP_TEXT
from app.tools.preflight import busy_ports, fault_injection_refusal, refusal
from app.tools.procs import MARKER, base_url_of, kill_run, new_run_env, read_deploy_failure, read_readiness, rpc_dir_prefix

_STOP_GRACE_S = 90


def main(argv: list[str]) -> int:
    config = argv[0] if argv else "configs/local-cpu.yaml"
    if (refused := fault_injection_refusal(dict(os.environ))) is not None:
        print(refused, file=sys.stderr, flush=True)
        return 2
    # Onto a running cluster, its proxy holds the HTTP port already and its engines bind on its hosts: nothing to check.
    busy = [] if onto_cluster(os.environ) else busy_ports(_read(config))
    if busy:
        print(refusal(config, busy), file=sys.stderr, flush=True)
        return 2
    env = new_run_env(keep_existing=True)
    run_id = env[MARKER]
    # vLLM's processes make their ZeroMQ IPC sockets in VLLM_RPC_BASE_PATH (default: /tmp) and leave them
    # there when they are ended: in a directory of the run's own instead, removed with the run (engines of
    # a cluster we deploy onto have their nodes' environment, not ours).
    rpc_dir = None
    if "VLLM_RPC_BASE_PATH" not in env and not onto_cluster(env):
        rpc_dir = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix=rpc_dir_prefix(run_id))
    print(f"[rendezvous] serve run {config} (run id {run_id}); Ctrl-C stops everything", file=sys.stderr, flush=True)
    stop_requested_at: list[float] = []
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        if not stop_requested_at:
            stop_requested_at.append(time.monotonic())
            print(f"[rendezvous] stopping ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGINT)

    # Handlers first: a signal that is caught (not ignored) here is reset to the default
    # in serve run, so its Ctrl-C handling works even when we were started with SIGINT
    # ignored (as a background job of a script is).
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    # Own session, so a terminal's Ctrl-C reaches serve run once, through us.
    child = subprocess.Popen(
        serve_run_argv(config, argv[1:], env),
        env=env,
        start_new_session=True,
    )
    gave_up: list[str] = []
    threading.Thread(target=_say_when_ready, args=(config, child, gave_up), daemon=True).start()
    try:
        code = _wait_for(child, stop_requested_at, gave_up)
    finally:
        left = kill_run(run_id)
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)
        print(
            "[rendezvous] stopped; all processes ended" if not left else f"[rendezvous] could not end {left}",
            file=sys.stderr,
            flush=True,
        )
    return 1 if gave_up else code


def onto_cluster(env: Mapping[str, str]) -> bool:
    """Whether serve run deploys onto a running cluster (``RAY_ADDRESS``, as ``app.tools.cluster`` sets it) rather
    than starting a Ray here: then the cluster's nodes hold the ports and run the engines, with their environment."""
    return bool(env.get("RAY_ADDRESS"))


def serve_run_argv(config: str, extra: list[str], env: Mapping[str, str]) -> list[str]:
    """``serve run CONFIG`` on a Ray of its own unless told where: ``RAY_ADDRESS``, or an address among ``extra``
    (after ours, so it wins: click takes an option's last value). Without an address Ray joins the cluster a
    ``ray start`` on this host recorded (/tmp/ray/ray_current_cluster), even one that has gone: the app then
    waited on a dead GCS, and Ctrl-C would not have stopped a live one."""
    own = [] if onto_cluster(env) else ["--address", "local"]
    return [sys.executable, "-m", "ray.serve.scripts", "run", config, *own, *extra]


def _read(config: str) -> dict:
    """The config file's contents; empty if it cannot be read (serve run then says why)."""
    try:
        return yaml.safe_load(Path(config).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}


def _base_url(config: str) -> str:
    return base_url_of(_read(config))


def _say_when_ready(config: str, child: subprocess.Popen, gave_up: list[str], period_s: float = 3.0) -> None:
    """One line per change of the app's readiness while it starts, then one line once it
    can answer (``app.ingress.readiness``): what to wait for, instead of reading Ray's logs. Why
    replicas fail to start, as soon as Serve says; once Serve gives up on them, or on the whole
    app before its ingress answers (``procs.read_deploy_failure``), the app cannot start: say so,
    note it in ``gave_up`` and stop ``child``."""
    base = _base_url(config)
    last = failure = None
    while child.poll() is None:
        body = (read_readiness(f"{base}/ready") or (None, None))[1]
        if body is not None and body.get("ready"):
            print(
                f"[rendezvous] ready: {base}/v1 — {body.get('mode')}, {body.get('prefill_replicas')} prefill + "
                f"{body.get('decode_replicas')} decode",
                file=sys.stderr, flush=True,
            )
            return
        # Before an ingress replica runs, Serve's proxy answers for it (app.ingress.proxy_gate): "ingress".
        state = None if body is None else (
            f"ingress {body['ingress']}" if "ingress" in body else f"decode {body.get('decode')}; prefill {body.get('prefill')}")
        if state is not None and state != last:
            last = state
            print(f"[rendezvous] starting: {state}", file=sys.stderr, flush=True)
        # No ingress answering: Serve may have given up on the app before it had one (code that does not import).
        failed = read_deploy_failure() if body is None else None
        if failed is not None or (body is not None and body.get("failure") and body["failure"] != failure):
            failure = failed or body["failure"]
            print(f"[rendezvous] {failure}", file=sys.stderr, flush=True)
            if failed is not None or GAVE_UP_TEXT in failure:
                print("[rendezvous] the app cannot start; stopping", file=sys.stderr, flush=True)
                gave_up.append(failure)
                child.send_signal(signal.SIGINT)
                return
        time.sleep(period_s)


def _wait_for(child: subprocess.Popen, stop_requested_at: list[float], gave_up: list[str]) -> int:
    """The child's exit code; once a stop was asked for (or the start failed), at most
    ``_STOP_GRACE_S`` more (serve run shuts Serve and Ray down on SIGINT; a second SIGINT
    would abort that), then the caller's sweep ends whatever is left."""
    while True:
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            if gave_up and not stop_requested_at:
                stop_requested_at.append(time.monotonic())
            if stop_requested_at and time.monotonic() - stop_requested_at[0] > _STOP_GRACE_S:
                return -signal.SIGINT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
