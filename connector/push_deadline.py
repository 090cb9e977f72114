"""A deadline on pushed KV (vLLM-side; imports neither Ray nor ``app``).

Upstream, a decode request whose prefill never WRITEs (prefill dead, stalled, or its leg
aborted) waits forever, and if it is aborted its blocks are never freed (vLLM frees them
only once the KV arrived). Decode now stamps each registration with a wall-clock expiry
(``rendezvous_kv_timeout_s`` in ``kv_connector_extra_config``); past it, the decode worker
reports the load as failed, so the scheduler recomputes the prompt locally
(``kv_load_failure_policy: recompute``) or, for an aborted request, frees its blocks.
Prefill never starts a WRITE into a registration within ``WRITE_MARGIN_S`` of its expiry,
so a late prefill cannot write into blocks decode has already given away (clocks of the
two hosts must agree to well within that margin).

Swapped into vLLM's push scheduler and worker by ``connector.vllm_connectors``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector.params import WRITE_MARGIN_S

logger = logging.getLogger("vllm.rendezvous")  # under vllm: the engine processes log it

EXPIRES_KEY = "rendezvous_expires_at"  # added to each push registration (wall clock, seconds)


def registration_expired(registration: dict[str, Any], now: float, margin_s: float = 0.0) -> bool:
    """True once ``now`` is within ``margin_s`` of the registration's expiry (if it has one)."""
    expires_at = registration.get(EXPIRES_KEY)
    return expires_at is not None and now >= float(expires_at) - margin_s


class DeadlineScheduler(NixlPushConnectorScheduler):
    """Decode side: stamps each registration it stages with an expiry."""

    _kv_timeout_s: float | None = None

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None and self._kv_timeout_s and EXPIRES_KEY not in registration:
            registration[EXPIRES_KEY] = time.time() + self._kv_timeout_s


class DeadlineWorker(NixlPushConnectorWorker):
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
