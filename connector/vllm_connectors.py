"""vLLM-side KV connectors, loaded by vLLM through ``kv_connector_module_path``.

Thin subclasses of vLLM 0.29's NIXL push/pull connectors. Must not import Ray or ``app``
(they run inside vLLM's EngineCore and worker processes).

What they change: on CPU, vLLM's NIXL worker pins the engine's main thread to the last
core of each NUMA node (``base_worker.py``: "reserve different cores for
start_load_kv()"). That assumes one engine owns a many-core host; with several engines
on one host every engine's compute thread lands on the *same* core while the others
idle. We restore the affinity the process had before, so thread placement is whatever
the deployment configured (``VLLM_CPU_OMP_THREADS_BIND`` / ``OMP_NUM_THREADS``).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
    NixlPushConnector,
)

logger = logging.getLogger("rendezvous.vllm_connectors")

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
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)


class RendezvousPullConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
