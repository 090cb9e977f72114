"""Before ``make serve`` starts anything: are the ports this config binds on this host free?

Without it a second start on the same host split requests with the first (both Serve
proxies bound the HTTP port, Ray's with SO_REUSEPORT) while its engines died in their
NIXL listener threads and its replicas stayed "initializing" with nothing said. The ports
come from the config (one home: ``http_options`` and ``connector.ports.PortPlan`` through
``app.config.args``); who holds a busy one from ``connector.port_check``.

Also: KV fault injection (``connector.kv_checksum``) set outside a test or bench run refuses.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from app.config.args import AppArgs
from app.tools.procs import base_url_of
from connector.faults import FAULT_FILE_ENV, FAULTS_ALLOWED_ENV
from connector.port_check import holder, is_free
from connector.ports import Role

_OUR_BUILDER = "app.builder:build_app"


def planned_ports(config: dict[str, Any]) -> list[tuple[int, str]]:
    """(port, what) for every port a ``serve run`` of ``config`` binds on a single host: the
    HTTP proxy's and each engine's NIXL side channel (every replica a role may scale to,
    every DP rank). Applications that are not ours, or whose args do not parse (the start
    reports those itself), add only what can be read."""
    ports = [(urlsplit(base_url_of(config)).port, "HTTP (http_options.port)")]
    for app in config.get("applications") or []:
        if app.get("import_path") != _OUR_BUILDER:
            continue
        try:
            args = AppArgs.parse(app.get("args"))
        except ValueError:
            continue
        plan = args.nixl.port_plan()
        for role in Role:
            dp = args.engine_kwargs_for(role).get("data_parallel_size", 1)
            ports += [(port, f"{role.value} NIXL side channel") for port in plan.ports(role, args.role(role).max_replicas, dp)]
    return ports


def busy_ports(config: dict[str, Any]) -> list[str]:
    """One line per planned port that is taken, naming its holder; empty when all are free."""
    return [f"port {port}, {what}: held by {holder(port)}" for port, what in planned_ports(config) if not is_free(port)]


def refusal(config_path: str, busy: list[str]) -> str:
    return "\n".join([
        f"[rendezvous] cannot start {config_path}: ports it needs are taken on this host",
        *(f"  - {line}" for line in busy),
        "  Another rendezvous app still running? Stop it (Ctrl-C where it runs; `make clean-procs` ends every",
        "  rendezvous process on this host), or give this config other ports: http_options.port and",
        "  args.nixl.prefill_port_base / decode_port_base.",
    ])


def fault_injection_refusal(env: dict[str, str]) -> str | None:
    """Why not to start: KV fault injection (connector.kv_checksum) asked for outside a test or bench run."""
    if env.get(FAULT_FILE_ENV) and env.get(FAULTS_ALLOWED_ENV) != "1":
        return (f"[rendezvous] refusing to start: {FAULT_FILE_ENV} is set, which makes engines corrupt KV on purpose. "
                f"It is for tests and benchmarks only (they also set {FAULTS_ALLOWED_ENV}=1); unset it to serve.")
    return None

