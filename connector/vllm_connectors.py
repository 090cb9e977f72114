"""vLLM-side KV connectors, loaded by vLLM through ``kv_connector_module_path``.

Thin subclasses of vLLM 0.29's NIXL push/pull connectors. Must not import Ray or ``app``
(they run inside vLLM's EngineCore and worker processes).

What they change: on CPU, vLLM's NIXL worker pins the engine's main thread to the last
core of each NUMA node (``base_worker.py``: "reserve different cores for
start_load_kv()"). That assumes one engine owns a many-core host; with several engines
on one host every engine's compute thread lands on the *same* core while the others
idle. We restore the affinity the process had before, so thread placement is whatever
the deployment configured (``VLLM_CPU_OMP_THREADS_BIND`` / ``OMP_NUM_THREADS``).

They also tie each engine process to its parent's life. vLLM's EngineCore and worker
processes survive a killed Ray replica (``ray stop --force``, Ctrl-C of ``serve run``),
orphaned and still holding their NIXL side-channel ports, so the next start fails with
"Address already in use". The connector is the one piece of our code that runs inside
those processes, so it asks the kernel to send SIGTERM when the parent goes away
(``PR_SET_PDEATHSIG``); vLLM then shuts down as it does on any SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from contextlib import contextmanager

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
    NixlPushConnector,
)

logger = logging.getLogger("rendezvous.vllm_connectors")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> bool:
    """SIGTERM this process when its parent exits (Linux only); True if armed."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() == 1:  # the parent died before we armed it
        os.kill(os.getpid(), signal.SIGTERM)
    return True


@contextmanager
def _keep_cpu_affinity(role: KVConnectorRole):
    before = os.sched_getaffinity(0) if role == KVConnectorRole.WORKER else None
    try:
        yield
    finally:
        if before is not None and os.sched_getaffinity(0) != before:
            os.sched_setaffinity(0, before)
            logger.info("restored CPU affinity %s after NIXL worker init", sorted(before))


class RendezvousPushConnector(NixlPushConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)


class RendezvousPullConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
