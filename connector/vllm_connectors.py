"""vLLM-side KV connectors, loaded by vLLM through ``kv_connector_module_path``.

Thin subclasses of vLLM's NIXL push/pull connectors. Must not import Ray or ``app``
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

And they keep NIXL's UCX progress thread from busy-polling a core per engine
(``connector.nixl_progress``; UCX-only agents).

Our features (deadlines, history reuse, the idle wait, checksums, the stage clock, transfer
order, progressive push) are composed into vLLM's own connector scheduler and worker: ``connector.push_connector``
and ``connector.pull_connector`` override each vLLM hook once and call them in order.
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
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from connector.nixl_progress import calm_progress_threads
from connector.pull_connector import PullScheduler, PullWorker
from connector.push_connector import PushScheduler, PushWorker
from connector.settings import ConnectorSettings, backends

logger = logging.getLogger("vllm.rendezvous")  # under vllm: the engine processes log it

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


def _worker_meta(connector):
    """The worker's metadata for the scheduler (reuse offers in push, KV sums in pull); None on the scheduler side."""
    build = getattr(connector.connector_worker, "build_connector_worker_meta", None)
    return build() if build is not None else None


def _extend(obj, cls, settings: ConnectorSettings, vllm_config) -> None:
    """Give vLLM's own connector scheduler or worker our features: they are built first (``cls.init_features``,
    on ``obj`` as it is), then ``obj`` becomes a ``cls`` (a subclass of its class that overrides each hook once).
    Swapped in rather than constructed: vLLM builds both in its connector's ``__init__``, and building a second
    NIXL worker would open a second agent. Features before class: the push worker's writer thread is running
    already and reaches an overridden hook as soon as the class changes."""
    cls.init_features(obj, settings, vllm_config)
    obj.__class__ = cls


class RendezvousPushConnector(NixlPushConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings = ConnectorSettings.parse(extra)
        calm_progress_threads(backends(extra))
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            _extend(self.connector_scheduler, PushScheduler, settings, vllm_config)
        if self.connector_worker is not None:
            if getattr(self.connector_worker, "_is_hma_required", False):
                # vLLM reports no invalid blocks for multi-group KV: a failed load would look
                # like a finished one. Waiting is better than decoding garbage; and decode
                # offers no history for such models (see connector.push_reuse).
                logger.warning("the KV deadline, checksums and history reuse are off: the model has several KV cache groups")
            else:
                _extend(self.connector_worker, PushWorker, settings, vllm_config)

    build_connector_worker_meta = _worker_meta

    def wait_for_save(self):
        super().wait_for_save()
        if isinstance(self.connector_worker, PushWorker):  # the step's forward is done: its finished chunks go out
            self.connector_worker.saved(self._get_connector_metadata())


class RendezvousPullConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        settings = ConnectorSettings.parse(extra)
        calm_progress_threads(backends(extra))
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            _extend(self.connector_scheduler, PullScheduler, settings, vllm_config)
        if self.connector_worker is not None and type(self.connector_worker) is NixlPullConnectorWorker:
            _extend(self.connector_worker, PullWorker, settings, vllm_config)

    build_connector_worker_meta = _worker_meta
