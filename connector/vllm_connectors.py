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

Push only: a deadline on pushed KV. Upstream, a decode request whose prefill never
WRITEs (prefill dead, stalled, or its leg aborted) waits forever, and if it is aborted
its blocks are never freed (vLLM frees them only once the KV arrived). Decode now stamps
each registration with a wall-clock expiry (``rendezvous_kv_timeout_s`` in
``kv_connector_extra_config``); past it, the decode worker reports the load as failed, so
the scheduler recomputes the prompt locally (``kv_load_failure_policy: recompute``) or,
for an aborted request, frees its blocks. Prefill never starts a WRITE into a
registration within ``WRITE_MARGIN_S`` of its expiry, so a late prefill cannot write into
blocks decode has already given away (clocks of the two hosts must agree to well within
that margin).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
    NixlPushConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector.params import KV_TIMEOUT_KEY, WRITE_MARGIN_S

logger = logging.getLogger("rendezvous.vllm_connectors")

_PR_SET_PDEATHSIG = 1

EXPIRES_KEY = "rendezvous_expires_at"  # added to each push registration (wall clock, seconds)


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


def registration_expired(registration: dict[str, Any], now: float, margin_s: float = 0.0) -> bool:
    """True once ``now`` is within ``margin_s`` of the registration's expiry (if it has one)."""
    expires_at = registration.get(EXPIRES_KEY)
    return expires_at is not None and now >= float(expires_at) - margin_s


class _DeadlineScheduler(NixlPushConnectorScheduler):
    """Decode side: stamps each registration it stages with an expiry."""

    _kv_timeout_s: float | None = None

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None and self._kv_timeout_s and EXPIRES_KEY not in registration:
            registration[EXPIRES_KEY] = time.time() + self._kv_timeout_s


class _DeadlineWorker(NixlPushConnectorWorker):
    """Decode side: fails receives past their registration's expiry. Prefill side: never
    starts a WRITE into a registration about to expire, and drops expired ones."""

    _recv_expiry: dict[str, float]

    def start_load_kv(self, metadata):
        for req_id, registration in (metadata.push_registrations or {}).items():
            if EXPIRES_KEY in registration:
                self._recv_expiry[req_id] = float(registration[EXPIRES_KEY])
        super().start_load_kv(metadata)

    def get_finished(self):
        self._fail_expired_receives(time.time())
        return super().get_finished()

    def _fail_expired_receives(self, now: float) -> None:
        for req_id, expires_at in list(self._recv_expiry.items()):
            if now < expires_at:
                continue
            del self._recv_expiry[req_id]
            # Gone from the metadata: it arrived or failed already. A completion notif
            # that is being counted right now wins too.
            if req_id not in self._recving_metadata or req_id in self._recving_transfers:
                continue
            logger.warning("no KV pushed for %s before its deadline: reporting the load as failed", req_id)
            self.consumer_notification_counts_by_req.pop(req_id, None)
            self._handle_failed_transfer(req_id, None)

    def _do_start_push_kv(self, request_id, local_block_ids, registration_data):
        if registration_expired(registration_data, time.time(), WRITE_MARGIN_S):
            logger.warning("registration for %s expired before the WRITE: not pushing", request_id)
            return  # our blocks go back when the lease ends
        super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        super()._handle_push_reg_notif(notif)
        now = time.time()
        for req_id, registration in list(self._pending_d_registrations.items()):
            if registration_expired(registration, now, WRITE_MARGIN_S):
                del self._pending_d_registrations[req_id]


class RendezvousPushConnector(NixlPushConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        timeout_s = extra.get(KV_TIMEOUT_KEY)
        if self.connector_scheduler is not None:
            # Swapped in rather than constructed: vLLM builds its own scheduler and worker
            # here, and building a second NIXL worker would open a second agent.
            self.connector_scheduler.__class__ = _DeadlineScheduler
            self.connector_scheduler._kv_timeout_s = float(timeout_s) if timeout_s else None
        if self.connector_worker is not None:
            if getattr(self.connector_worker, "_is_hma_required", False) and timeout_s:
                # vLLM reports no invalid blocks for multi-group KV: a failed load would
                # look like a finished one. Waiting is better than decoding garbage.
                logger.warning("%s ignored: the model has several KV cache groups", KV_TIMEOUT_KEY)
            else:
                self.connector_worker.__class__ = _DeadlineWorker
                self.connector_worker._recv_expiry = {}


class RendezvousPullConnector(NixlPullConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        die_with_parent()
        with _keep_cpu_affinity(role):
            super().__init__(vllm_config, role, kv_cache_config)
