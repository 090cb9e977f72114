"""Is a port free on this host, and if not, who holds it (no Ray, no ``app``).

A second app on the same host used to hang: vLLM's NIXL side-channel listener died in its
thread (``ZMQError: Address already in use``) while the replica stayed "initializing" for
good. ``app.tools.preflight`` checks every planned port before anything starts; the engine
backend checks its own side channel before starting its engine (``connector.ray_backend``).
"""

from __future__ import annotations

import contextlib
import errno
import socket
import time

import psutil


def is_free(port: int, host: str = "0.0.0.0") -> bool:
    """Whether ``host:port`` is not taken now: a listener could bind it (as vLLM's and
    Serve's do, with SO_REUSEADDR: a port left in TIME_WAIT counts as free). Any other bind
    error (an address not on this host) is not ours to judge: the real bind will say."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno != errno.EADDRINUSE
    return True


def holder(port: int) -> str:
    """Who listens on ``port`` here, for a message: ``pid 123 (ray::ProxyActor)``, or what
    can be said without it."""
    try:
        connections = psutil.net_connections(kind="inet")
    except psutil.Error:
        return "a process this user cannot see"
    for conn in connections:
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            name = "?"
            with contextlib.suppress(psutil.Error):
                name = psutil.Process(conn.pid).name()
            return f"pid {conn.pid} ({name})"
    return "an unknown process"


class PortBusy(RuntimeError):
    pass


def wait_until_free(port: int, host: str, *, what: str, timeout_s: float, period_s: float = 0.5) -> None:
    """Return once ``host:port`` can be bound; raise :class:`PortBusy` naming the holder
    after ``timeout_s`` (an engine of a replica being replaced may hold it a few seconds
    while it dies)."""
    deadline = time.monotonic() + timeout_s
    while not is_free(port, host):
        if time.monotonic() >= deadline:
            raise PortBusy(
                f"{what} port {host}:{port} is held by {holder(port)} (still after {timeout_s:.0f} s). "
                "Another app on this host? End it (`make clean-procs` ends every rendezvous process here) "
                "or give this app other side-channel ports (args.nixl.prefill_port_base / decode_port_base)."
            )
        time.sleep(period_s)
