"""Is a port free on this host, and if not, who holds it (no Ray, no ``app``).

A second app on the same host used to hang: vLLM's NIXL side-channel listener died in its
thread (``ZMQError: Address already in use``) while the replica stayed "initializing" for
good. ``app.tools.preflight`` checks every planned port before anything starts; the engine
backend takes the first free block of its role's ports before starting its engine (``connector.ray_backend``).
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterable

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


def first_free_block(bases: Iterable[int], size: int, host: str, *, what: str) -> int:
    """The first of ``bases`` whose ``size`` ports from it are all free on ``host``; PortBusy naming the holder of
    the first one if none is."""
    bases = list(bases)
    for base in bases:
        if all(is_free(port, host) for port in range(base, base + size)):
            return base
    raise PortBusy(
        f"{what} port {host}:{bases[0]} is held by {holder(bases[0])}, and every other port of its range too. "
        "Another app on this host? End it (`make clean-procs` ends every rendezvous process here) "
        "or give this app other side-channel ports (args.nixl.prefill_port_base / decode_port_base)."
    )
