"""A deadline on pushed KV (vLLM-side; imports neither Ray nor ``app``).

Upstream, a decode request whose prefill never WRITEs (prefill dead, stalled, or its leg
aborted) waits forever, and if it is aborted its blocks are never freed (vLLM frees them
only once the KV arrived). Decode now stamps each registration with a wall-clock expiry:
the seconds its decode leg says (``KV_DEADLINE_KEY``: the orchestrator sizes them to the
request's work, ``app.request.deadlines``), else ``rendezvous_kv_timeout_s`` in
``kv_connector_extra_config``; past it, the decode worker
reports the load as failed, so the scheduler recomputes the prompt locally
(``kv_load_failure_policy: recompute``) or, for an aborted request, frees its blocks.
Prefill never starts a WRITE into a registration within ``WRITE_MARGIN_S`` of its expiry,
so a late prefill cannot write into blocks decode has already given away (clocks of the
two hosts must agree to well within that margin).

A prefill leg that is aborted before its KV was computed (the orchestrator gave up on it:
its fallback, a hang-up, the queue deadline) is never written. Upstream says nothing of it
to decode, whose aborted request then holds its blocks until their expiry, which is sized to
the request's work and can be minutes under load. So prefill tells decode at once
(``WONT_WRITE_NOTIF``, to every decode rank of a peer it has handshaken with), and decode
fails that receive as at its expiry: the blocks go back in a step. A leg that never reached
prefill's engine (cancelled in a router's queue, or while its replica prepared it) is unknown
there; so decode, when it aborts a request still waiting for its KV, withdraws the registration
(the same notification with ``DROP_KEY``, sent after it by the same writer thread): prefill
then treats that leg as aborted, and answers as above unless the WRITE has begun. A registration that
names other tokens than the leg's prompt (``connector.kv_identity``) is answered the same way, with the
reason.

Composed into vLLM's push scheduler and worker by ``connector.push_connector``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.feature import Feature
from connector.params import WRITE_MARGIN_S, kv_timeout_of
from connector.kv_identity import refused
from connector.side_notifs import WONT_WRITE_NOTIF, take
from connector.stages import KvFailure

logger = logging.getLogger("vllm.rendezvous")  # under vllm: the engine processes log it

EXPIRES_KEY = "rendezvous_expires_at"  # added to each push registration (wall clock, seconds)
DROP_KEY = "rendezvous_withdrawn"  # a registration sent again with it: decode aborted that request
# What a withdrawal keeps of its registration: whom it is for and who sends it (no blocks, no reuse offer).
_ADDRESSING = ("request_id", "decode_engine_id", "decode_host", "decode_port", "decode_tp_size", "remote_engine_id",
               "remote_host", "remote_port", "remote_tp_size", "remote_pp_size")
_ABORTED_KEPT_S = 600.0  # an aborted leg's registration comes within this, or never


def registration_expired(registration: dict[str, Any], now: float, margin_s: float = 0.0) -> bool:
    """True once ``now`` is within ``margin_s`` of the registration's expiry (if it has one)."""
    expires_at = registration.get(EXPIRES_KEY)
    return expires_at is not None and now >= float(expires_at) - margin_s


class DeadlineScheduler(Feature):
    """Decode side: stamps each registration it stages with an expiry, and withdraws the
    registration of a request aborted before its KV landed."""

    UPSTREAM = frozenset({"_push_pending_registrations"})

    def __init__(self, host, kv_timeout_s: float | None) -> None:
        super().__init__(host)
        self._kv_timeout_s = kv_timeout_s
        self._registered: dict[str, dict[str, Any]] = {}  # request id -> its registration, until the request ends

    def timeout_of(self, request) -> float | None:
        """The request's KV deadline (seconds), read before vLLM rewrites its params."""
        return kv_timeout_of(request.kv_transfer_params, self._kv_timeout_s)

    def stamp(self, request, timeout_s: float | None) -> None:
        """After vLLM staged the request's registration: stamp its expiry."""
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None:
            if timeout_s and EXPIRES_KEY not in registration:
                registration[EXPIRES_KEY] = time.time() + timeout_s
            self._registered[request.request_id] = registration

    def finishing(self, request) -> dict[str, Any] | None:
        """Before vLLM's request_finished: the request's registration, if it had one."""
        return self._registered.pop(request.request_id, None)

    def withdraw_if_unlanded(self, request, registration: dict[str, Any] | None) -> None:
        """After vLLM's request_finished. Nothing computed yet: its KV never landed (vLLM sets the count once it
        has). The worker ships the withdrawal like any registration, after the one it withdraws."""
        if registration is not None and request.num_computed_tokens == 0:
            withdrawal = {key: registration[key] for key in _ADDRESSING if key in registration}
            self._push_pending_registrations[request.request_id] = {**withdrawal, DROP_KEY: True}


class DeadlineWorker(Feature):
    """Decode side: fails receives past their registration's expiry. Prefill side: never
    starts a WRITE into a registration about to expire, and drops expired ones."""

    UPSTREAM = frozenset({"_recving_metadata", "_recving_transfers", "_pending_completion_notifs",
                          "consumer_notification_counts_by_req", "_failed_recv_reqs", "_pending_d_registrations",
                          "_remote_agents", "nixl_wrapper"})

    def __init__(self, host, may_release=lambda base_id: True) -> None:
        super().__init__(host)
        self._may_release = may_release  # False while a chunk WRITE of the leg may still land (connector.progressive)
        self._recv_expiry: dict[str, float] = {}
        self._aborted_legs: dict[str, float] = {}  # prefill side: base request id -> when its leg was aborted (monotonic)

    def loading(self, metadata) -> None:
        """Before vLLM's start_load_kv: the step's registrations (their expiry) and aborted legs."""
        for req_id, registration in (metadata.push_registrations or {}).items():
            if EXPIRES_KEY in registration:
                self._recv_expiry[req_id] = float(registration[EXPIRES_KEY])
        now = time.monotonic()
        for req_id in metadata.reqs_not_processed or ():  # prefill legs aborted before they finished
            self._aborted_legs[get_base_request_id(req_id)] = now
        for base_id, at in list(self._aborted_legs.items()):
            if now - at > _ABORTED_KEPT_S:
                self._aborted_legs.pop(base_id, None)
        self._release_aborted()

    def take_notifs(self) -> None:
        """Before vLLM reads the step's notifications: prefill's won't-write notices."""
        for notif in take(self._pending_completion_notifs, WONT_WRITE_NOTIF):
            # "<request id>", or "<request id> kv_mismatch": the registration names other tokens (connector.kv_identity).
            req_id, _, why = notif[len(WONT_WRITE_NOTIF):].decode(errors="replace").partition(" ")
            if req_id in self._recving_metadata and req_id not in self._recving_transfers:
                if why == KvFailure.MISMATCH.value:
                    refused(req_id, "prefill's leg computed other tokens")
                    self._recv_expiry[req_id] = 0.0
                    continue
                logger.info("prefill will not WRITE %s (its leg was aborted, or a chunk WRITE failed): decode's blocks "
                            "go back now", req_id)
                self._recv_expiry[req_id] = 0.0  # failed at the next step, as at its expiry

    def _release_aborted(self) -> None:
        """Prefill side: tell decode that the registrations of aborted legs will never be written."""
        if not self._aborted_legs:
            return  # every step of every engine: nothing to look at
        for rid, registration in list(self._pending_d_registrations.items()):
            base_id = get_base_request_id(rid)
            if base_id not in self._aborted_legs or not self._may_release(base_id):
                continue  # not aborted; or asked again at the next step, once its chunk WRITEs are done
            if self._pending_d_registrations.pop(rid, None) is None:
                continue  # the writer thread took it meanwhile
            agents = (self._remote_agents.get(registration.get("decode_engine_id")) or {}).values()
            for agent_name in agents:
                try:
                    self.nixl_wrapper.send_notif(agent_name, notif_msg=WONT_WRITE_NOTIF + str(registration["request_id"]).encode())
                except Exception:  # decode's expiry frees the blocks all the same
                    logger.debug("won't-write notice for %s not sent", rid, exc_info=True)

    def fail_expired_receives(self, now: float) -> None:
        """Before vLLM's get_transfer_results, which reports what is queued as failed."""
        for req_id, expires_at in list(self._recv_expiry.items()):
            if now < expires_at:
                continue
            del self._recv_expiry[req_id]
            # Gone from the metadata: it arrived or failed already. A completion notif
            # that is being counted right now wins too.
            if req_id not in self._recving_metadata or req_id in self._recving_transfers:
                continue
            if expires_at:
                logger.warning("no KV pushed for %s before its deadline: reporting the load as failed", req_id)
            else:
                logger.warning("prefill will not WRITE %s: reporting the load as failed", req_id)
            self.consumer_notification_counts_by_req.pop(req_id, None)
            self._failed_recv_reqs.put(req_id)

    def may_write(self, request_id: str, registration_data: dict[str, Any]) -> bool:
        if registration_expired(registration_data, time.time(), WRITE_MARGIN_S):
            logger.warning("registration for %s expired before the WRITE: not pushing", request_id)
            return False  # our blocks go back when the lease ends
        return True

    def withdrawn(self, notif: bytes) -> bool:
        """A registration notification that withdraws one (never to vLLM: it would WRITE into the blocks)."""
        if _DROP_MARK in notif and (request_id := _withdrawn(notif)) is not None:
            logger.info("decode withdrew its registration for %s", request_id)
            self._aborted_legs[get_base_request_id(request_id)] = time.monotonic()
            self._release_aborted()
            return True
        return False

    def registered(self) -> None:
        """After vLLM took a registration: drop expired ones; answer one that came after its leg was aborted."""
        now = time.time()
        for req_id, registration in list(self._pending_d_registrations.items()):
            if registration_expired(registration, now, WRITE_MARGIN_S):
                del self._pending_d_registrations[req_id]
        self._release_aborted()


_DROP_MARK = DROP_KEY.encode()


def _withdrawn(notif: bytes) -> str | None:
    """The request id of a withdrawal (a registration with ``DROP_KEY``), else None."""
    try:
        registration = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
    except Exception:
        return None
    if isinstance(registration, dict) and registration.get(DROP_KEY) and isinstance(registration.get("request_id"), str):
        return registration["request_id"]
    return None
