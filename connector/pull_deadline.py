"""A deadline on pulled KV (vLLM-side; imports neither Ray nor ``app``).

Upstream, a READ that never completes (a transfer stuck in the transport, a producer that went
away mid-READ without an error) leaves its request waiting for remote KV until something aborts
it: for us the ingress's queue deadline, a 503. Decode's worker now gives each READ it posts
``rendezvous_kv_timeout_s`` (``handoff.read_timeout_s``); past it, the worker releases the READ's
NIXL handles, which cancels what is still in flight, and reports the load as failed: the scheduler
recomputes the prompt (``kv_load_failure_policy: recompute``), counted as ``prefill="kv_deadline"``
(``connector.stages``: a failure at the deadline is the deadline's).

A handle NIXL cannot cancel is not freed (NIXL says so with an error): then the READ may still
write, so its blocks are not given back; the worker keeps waiting for it and tries again at the
next step. Only UCX cancels what it releases: NIXL's LIBFABRIC backend answers a release of a
posted READ with success without cancelling it, so a READ "cancelled" there could still land in
blocks already recomputed into or reused. On any backend but UCX a posted READ is therefore never
given up: it keeps its blocks until NIXL reports it done or failed (a READ never posted still
fails at its deadline). Only READs that were posted count: one still waiting for its handshake is bounded by
vLLM's own handshake timeout.

Test-only faults (``connector.kv_checksum``'s switch), only where the deadline ends them: ``stall-read``
posts no READ at all, as a transfer that never progresses would look; ``drop-rank`` never READs the
last of several producer ranks' shares, while the others land: vLLM would count the request as
received once the posted READs are done, so the request is held back until its deadline (decode must
never start on part of its KV).

Composed into vLLM's pull worker by ``connector.pull_connector`` (both roles: prefill's READ of a
conversation's history from decode, ``pull_history: upstream``, gets the same deadline).
"""

from __future__ import annotations

import logging
import time

from connector.feature import Feature
from connector.faults import injected_fault

logger = logging.getLogger("vllm.rendezvous")  # under vllm: the engine processes log it


class ReadDeadline(Feature):
    """On the pull worker."""

    UPSTREAM = frozenset({"_recving_transfers", "_failed_recv_reqs", "nixl_wrapper", "transfer_topo"})

    def __init__(self, host, timeout_s: float | None, reads_cancel: bool) -> None:
        super().__init__(host)
        # reads_cancel: a release cancels a posted READ (UCX only)
        self._read_timeout_s, self._reads_cancel = timeout_s, reads_cancel
        self._read_posted: dict[str, float] = {}  # request id -> when its READ was posted (monotonic)
        self._read_stalled: set[str] = set()  # fault injection: READs never posted
        self._read_uncancelled: set[str] = set()  # late READs NIXL could not cancel (logged once each)

    def may_read(self, req_id) -> bool:
        """Before vLLM posts a request's READs: start its clock; False to post none (a test fault)."""
        if not self._read_timeout_s:
            return True
        self._read_posted[req_id] = time.monotonic()
        if injected_fault() == "stall-read":  # only where the deadline will end it
            self._read_stalled.add(req_id)
            logger.warning("fault injection: %s's READ is never posted", req_id)
            return False
        return True

    def may_read_rank(self, spec, dst_engine_id: str, req_id: str) -> bool:
        """Before vLLM posts one producer rank's READ (``_read_blocks``); False to skip it."""
        if self._read_timeout_s and injected_fault() == "drop-rank":
            producers = self.transfer_topo.get_engine_info(dst_engine_id).remote_tp_size
            if producers > 1 and spec.remote_rank == producers - 1:
                self._read_stalled.add(req_id)
                logger.warning("fault injection: %s's share on producer rank %d is never READ", req_id, spec.remote_rank)
                return False  # the other ranks' READs go on, and the deadline ends the request
        return True

    def landed(self, transfers, done: set) -> set:
        """After vLLM's _pop_done_transfers: a READ part of whose KV was never READ is not received."""
        return done - self._read_stalled if transfers is self._recving_transfers else done

    def reported(self, results) -> None:
        """After vLLM's get_transfer_results: the receives it reported need no clock."""
        for req_id in results.finished_recving:
            self._read_posted.pop(req_id, None)
            self._read_uncancelled.discard(req_id)

    def cancel_late_reads(self, now: float) -> None:
        clock, stalled = self._read_posted, self._read_stalled
        for req_id, posted in list(clock.items()):
            if now - posted < self._read_timeout_s:
                continue
            if req_id not in self._recving_transfers and req_id not in stalled:
                clock.pop(req_id)  # done or failed already; vLLM reports it in this step
                continue
            handles = self._recving_transfers.get(req_id, [])
            if handles and not self._reads_cancel:
                if req_id not in self._read_uncancelled:
                    self._read_uncancelled.add(req_id)
                    logger.warning("READ of %s past its deadline: this NIXL backend cannot cancel a posted READ, so "
                                   "its blocks are kept until it completes or fails", req_id)
                continue
            while handles:
                try:
                    self.nixl_wrapper.release_xfer_handle(handles[0])
                except Exception as e:  # NIXL could not cancel it: it may still write, so keep the blocks
                    if req_id not in self._read_uncancelled:
                        self._read_uncancelled.add(req_id)
                        logger.warning("READ of %s past its deadline could not be cancelled (%s); waiting for it",
                                       req_id, e)
                    break
                handles.pop(0)
            if handles:
                continue
            self._recving_transfers.pop(req_id, None)
            stalled.discard(req_id)
            clock.pop(req_id)
            logger.warning("READ of %s not done %.0f s after it was posted: cancelled; its KV is recomputed",
                           req_id, now - posted)
            self._failed_recv_reqs.put(req_id)  # reported failed by the get_transfer_results that follows
