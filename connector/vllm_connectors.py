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

And they keep NIXL's UCX progress thread from busy-polling a core per engine
(``connector.nixl_progress``; UCX-only agents).

Push only, in their own modules: a deadline on pushed KV (``connector.push_deadline``),
reuse of a conversation's history held by decode (``connector.push_reuse``), and engines
that sleep instead of stepping while they only wait for KV (``connector.idle_wait``), and
checksums of pushed KV, checked on landing (``connector.kv_checksum``). Pull only:
vLLM's own history read-back, kept to the turns that ask (``connector.pull_history``), and
checksums of pulled KV, carried with the request (``connector.pull_checksum``), and a deadline
on each READ (``connector.pull_deadline``). Both:
transfers that start before the forward pass where it blocks (``connector.transfer_order``).
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

from connector.idle_wait import IdleScheduler, IdleWorker
from connector.kv_checksum import KvChecksums
from connector.nixl_progress import calm_progress_threads, reads_cancel
from connector.pull_checksum import PullSumsScheduler, PullSumsWorker
from connector.pull_deadline import ReadDeadline
from connector.pull_history import HistoryPullScheduler
from connector.stages import StageClock, WriteClock
from connector.settings import ConnectorSettings, backends
from connector.transfer_order import TransfersFirst

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


def _settings(vllm_config) -> tuple[ConnectorSettings, list[str]]:
    """Ours, parsed once (a misspelt key fails the engine's start, before NIXL is set up), and the NIXL backends."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    return ConnectorSettings.parse(extra), backends(extra)


def _worker_meta(connector):
    """The worker's metadata for the scheduler (reuse offers in push, KV sums in pull); None on the scheduler side."""
    build = getattr(connector.connector_worker, "build_connector_worker_meta", None)
    return build() if build is not None else None


class PushScheduler(TransfersFirst, StageClock, IdleScheduler):
    pass


class PullScheduler(PullSumsScheduler, TransfersFirst, StageClock, HistoryPullScheduler):
    pass


class PullWorker(PullSumsWorker, ReadDeadline, NixlPullConnectorWorker):
    pass


class PushWorker(KvChecksums, WriteClock, IdleWorker):
    pass


class RendezvousPushConnector(NixlPushConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        settings, nixl_backends = _settings(vllm_config)
        calm_progress_threads(nixl_backends)
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
        # Swapped in rather than constructed: vLLM builds its own scheduler and worker in
        # __init__, and building a second NIXL worker would open a second agent.
        if self.connector_scheduler is not None:
            self.connector_scheduler.__class__ = PushScheduler
            self.connector_scheduler._kv_timeout_s = settings.kv_timeout_s
            self.connector_scheduler._registered = {}
            self.connector_scheduler.init_reuse()
            self.connector_scheduler.init_idle(vllm_config)
        if self.connector_worker is not None:
            if getattr(self.connector_worker, "_is_hma_required", False):
                # vLLM reports no invalid blocks for multi-group KV: a failed load would look
                # like a finished one. Waiting is better than decoding garbage; and decode
                # offers no history for such models (see connector.push_reuse).
                logger.warning("the KV deadline, checksums and history reuse are off: the model has several KV cache groups")
            else:
                self.connector_worker.__class__ = PushWorker
                self.connector_worker._kv_checksums = settings.kv_checksums
                self.connector_worker._recv_expiry = {}
                self.connector_worker._aborted_legs = {}
                self.connector_worker.init_reuse()
                self.connector_worker.init_idle()

    build_connector_worker_meta = _worker_meta


class RendezvousPullConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        settings, nixl_backends = _settings(vllm_config)
        calm_progress_threads(nixl_backends)
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
        checksums, timeout_s = settings.kv_checksums, settings.kv_timeout_s  # timeout_s: a READ's deadline
        if self.connector_scheduler is not None:  # swapped in, as for push above
            self.connector_scheduler.__class__ = PullScheduler
            self.connector_scheduler._kv_checksums = checksums
            self.connector_scheduler._kv_timeout_s = timeout_s  # tells a failure at the deadline (connector.stages)
        if self.connector_worker is not None and type(self.connector_worker) is NixlPullConnectorWorker:
            self.connector_worker.__class__ = PullWorker
            self.connector_worker._kv_checksums = checksums
            self.connector_worker._kv_peer_tp = settings.kv_peer_tp_size
            self.connector_worker._read_timeout_s = timeout_s
            self.connector_worker._reads_cancel = reads_cancel(nixl_backends)

    build_connector_worker_meta = _worker_meta
