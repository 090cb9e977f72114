"""Push + bi-directional KV: prefill reuses a conversation's history that decode holds
(vLLM-side; imports neither Ray nor ``app``).

Upstream vLLM reads history back from decode only in pull mode (its push scheduler
raises ``NotImplementedError`` for ``bidirectional_kv_xfer``), and it trusts a token
count sent by the client. Here, for a conversation turn (``REUSE_KEY`` on both legs):

1. Decode's prefix cache (salted per conversation by the orchestrator) finds the longest
   block-aligned prefix of the new prompt whose KV it holds. The hit is by hash of the
   token ids themselves, so what is reused was verified against the tokens actually
   held — an edited history matches up to the first changed block. Decode allocates
   blocks only for the rest and adds the hit's block ids (the *offer*) to the push
   registration it sends prefill anyway. While that decode request lives, the offered
   blocks are referenced by it and cannot be evicted.
2. Prefill's scheduler holds the request back (``None`` from
   ``get_num_new_matched_tokens``, at most ``REUSE_OFFER_WAIT_S``) until its worker has
   the offer (handed over as ``KVConnectorWorkerMetadata``), then loads the offered
   prefix asynchronously — a NIXL READ from decode's blocks, D→P — and computes only the
   new tokens. Fewer than ``kv_recompute_threshold`` reusable tokens: it recomputes.
3. Prefill pushes as always; vLLM trims the WRITE to the blocks decode registered, so
   only the new tail travels P→D.

Prefill reports what it did (tokens reused and pushed, or why not) in the
``kv_transfer_params`` of its response (``REUSE_REPORT_KEY``).

Not for models with several KV cache groups (hybrid attention): decode offers nothing.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.params import REUSE_KEY, REUSE_OFFER_WAIT_S, REUSE_REPORT_KEY, ReuseReason, ReuseReport, is_prefill_leg, kv_bytes_per_token, reusable_tokens
from connector.feature import Feature
from connector.side_notifs import HISTORY_READ_ID, take

logger = logging.getLogger("vllm.rendezvous")  # under vllm: the engine processes log it

OFFER_KEY = "rendezvous_history"  # added to a conversation turn's push registration
# HISTORY_READ_ID (connector.side_notifs) names the READ in the notification NIXL delivers to
# decode; decode drops it (the offered blocks are held by the decode request itself).
_READING = "_rendezvous_reading"  # prefill request params: tokens it decided to load
_OFFER_TTL_S = 120.0  # offers nobody claimed (the prefill leg never came) are dropped


@dataclass
class ReuseOffers(KVConnectorWorkerMetadata):
    """Prefill worker → scheduler: offers that arrived, by decode request id."""

    offers: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Prefill requests whose history READ landed wrong (connector.kv_checksum): recomputed, reported so.
    mismatched: set[str] = field(default_factory=set)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "ReuseOffers":
        merged = dict(self.offers)
        merged.update(getattr(other, "offers", {}))
        return ReuseOffers(merged, self.mismatched | set(getattr(other, "mismatched", ())))


class ReuseScheduler(Feature):
    """Decode side: offers its prefix-cache hit. Prefill side: waits for the offer, loads it."""

    UPSTREAM = frozenset({"block_size", "kv_recompute_threshold", "_push_pending_registrations", "_reqs_need_recv",
                          "get_exchange_clipped_blocks"})

    def __init__(self, host) -> None:
        super().__init__(host)
        self._offers: dict[str, tuple[float, dict[str, Any]]] = {}  # base request id → (arrived, offer)
        self._waiting_since: dict[str, float] = {}
        self._reports: dict[str, ReuseReport] = {}
        self._single_group = len(host.kv_cache_config.kv_cache_groups) == 1
        self._kv_bytes_per_token = kv_bytes_per_token(host.vllm_config)

    # ---- prefill side

    @staticmethod
    def wants(request) -> bool:
        """A prefill leg of a conversation turn: its matched tokens are ours to say (``matched_tokens``)."""
        params = request.kv_transfer_params
        return bool(params and params.get(REUSE_KEY) and is_prefill_leg(params))

    def matched_tokens(self, request, num_computed_tokens):
        """vLLM's get_num_new_matched_tokens for a leg that ``wants`` reuse."""
        params = request.kv_transfer_params
        rid = request.request_id
        if params.get(_READING):  # asked again (the blocks could not be allocated last step)
            return max(0, params[_READING] - num_computed_tokens), params[_READING] > num_computed_tokens
        if not self._single_group:
            return self._no_reuse(rid, ReuseReason.UNSUPPORTED)
        arrived = self._offers.get(get_base_request_id(rid))
        if arrived is None:
            since = self._waiting_since.setdefault(rid, time.monotonic())
            if time.monotonic() - since < REUSE_OFFER_WAIT_S:
                return None, False  # asked again next step
            return self._no_reuse(rid, ReuseReason.NO_OFFER)
        offer = arrived[1]
        reusable = reusable_tokens(offer["num_tokens"], request.num_prompt_tokens, self.block_size)
        count = reusable - num_computed_tokens
        pushed = offer["registered_blocks"] * self.block_size
        if reusable == 0:
            return self._no_reuse(rid, ReuseReason.NO_MATCH, pushed=pushed)
        if count < max(1, self.kv_recompute_threshold):
            return self._no_reuse(rid, ReuseReason.THRESHOLD, pushed=pushed)
        params.update(
            remote_engine_id=offer["engine_id"],
            remote_host=offer["host"],
            remote_port=offer["port"],
            tp_size=offer["tp_size"],
            remote_block_ids=[list(offer["block_ids"][: reusable // self.block_size])],
            remote_request_id=HISTORY_READ_ID,
        )
        params[_READING] = reusable
        self._reports[rid] = self._report(ReuseReason.REUSED, reused=count, pushed=pushed)
        logger.debug("request %s: reading %d history tokens back from %s", rid, count, offer["engine_id"])
        return count, True

    def _report(self, reason: ReuseReason, reused: int = 0, pushed: int = 0) -> ReuseReport:
        return ReuseReport(reason.value, reused, pushed, self._kv_bytes_per_token)

    def _no_reuse(self, rid: str, reason: ReuseReason, pushed: int = 0):
        self._waiting_since.pop(rid, None)
        self._reports[rid] = self._report(reason, pushed=pushed)
        return 0, False

    def allocated(self, request, blocks, num_external_tokens) -> None:
        """After vLLM's update_state_after_alloc (and our deadline's stamp)."""
        params = request.kv_transfer_params
        if not params or not params.get(REUSE_KEY):
            return
        if is_prefill_leg(params):  # prefill: load the history into the blocks just allocated
            if params.get(_READING) and num_external_tokens > 0:
                params[REUSE_KEY] = False  # one load per request
                local = self.get_exchange_clipped_blocks(blocks.get_unhashed_block_ids_all_groups())
                # (request, blocks, cached, awaiting_kvs): the request waits in WAITING_FOR_REMOTE_KVS
                self._reqs_need_recv[request.request_id] = (request, local, (), True)
            return
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is not None:  # decode: offer the blocks of the prefix-cache hit
            hit = [b.block_id for b in blocks.blocks[0] if b.block_hash is not None and not b.is_null]
            if not self._single_group:
                hit = []
            registration[OFFER_KEY] = {"block_ids": hit, "num_tokens": len(hit) * self.block_size}

    def output(self, connector_output) -> None:
        """After vLLM's update_connector_output."""
        now = time.monotonic()
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ReuseOffers):
            for rid, offer in meta.offers.items():
                self._offers[get_base_request_id(rid)] = (now, offer)
            for rid in meta.mismatched & self._reports.keys():
                self._reports[rid] = self._report(ReuseReason.MISMATCH, pushed=self._reports[rid].pushed_tokens)
        for key in [k for k, (t, _) in self._offers.items() if now - t > _OFFER_TTL_S]:
            del self._offers[key]

    def finished(self, request, params: dict[str, Any] | None) -> None:
        """After vLLM's request_finished: the turn's report goes into the params it returned."""
        rid = request.request_id
        self._waiting_since.pop(rid, None)
        self._offers.pop(get_base_request_id(rid), None)
        report = self._reports.pop(rid, None)
        if report is not None and params is not None:
            params[REUSE_REPORT_KEY] = report.to_wire()


class ReuseWorker(Feature):
    """Prefill side: hands offers to the scheduler and READs the history it decides to load.
    Decode side: drops the notifications those READs send it. The READ itself is vLLM's pull READ,
    borrowed by the push worker (``connector.push_connector``)."""

    UPSTREAM = frozenset({"_pending_completion_notifs", "_recving_metadata", "_failed_recv_reqs",
                          "_physical_blocks_per_logical_kv_block", "_logical_to_kernel_block_ids",
                          "_as_grouped_block_ids", "_ensure_handshake", "_read_blocks_for_req"})

    def __init__(self, host) -> None:
        super().__init__(host)
        self._offer_inbox: queue.Queue = queue.Queue()  # writer thread → main thread
        self._handshaken: queue.Queue = queue.Queue()  # handshake executor → main thread: (request id, meta, error)

    def on_registration(self, notif: bytes) -> None:
        """A registration came (writer thread): its offer, if any, goes to the scheduler."""
        try:
            registration = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
            offer = registration.get(OFFER_KEY)
        except Exception:
            offer = None  # vLLM logs the undecodable payload below
        if offer is not None:
            self._offer_inbox.put((registration["request_id"], {
                **offer,
                "engine_id": registration["decode_engine_id"],
                "host": registration["decode_host"],
                "port": registration["decode_port"],
                "tp_size": registration["decode_tp_size"],
                "registered_blocks": len(self._as_grouped_block_ids(registration["local_block_ids"])[0]),
            }))

    def worker_meta(self) -> ReuseOffers | None:
        offers = {}
        while True:
            try:
                rid, offer = self._offer_inbox.get_nowait()
            except queue.Empty:
                break
            offers[rid] = offer
        return ReuseOffers(offers) if offers else None

    @staticmethod
    def take_history_reads(metadata) -> dict[str, Any]:
        """Before vLLM's start_load_kv: the step's history READs, which the push worker would take for pushes."""
        reads = {rid: m for rid, m in metadata.reqs_to_recv.items() if m.remote and m.remote.request_id == HISTORY_READ_ID}
        for rid in reads:
            del metadata.reqs_to_recv[rid]
        return reads

    def start_history_reads(self, reads: dict[str, Any]) -> None:
        """After vLLM's start_load_kv: READ the histories (once their handshake is done)."""
        for rid, meta in reads.items():
            meta.local_physical_block_ids = self._logical_to_kernel_block_ids(
                meta.local_block_ids, self._physical_blocks_per_logical_kv_block
            )
            self._recving_metadata[rid] = meta  # for failure handling, as a pull READ
            handshake = self._ensure_handshake(meta.remote.engine_id, meta.remote.host, meta.remote.port, meta.tp_size)
            if handshake is None:
                self._read_history(rid, meta)
            else:
                handshake.add_done_callback(lambda f, rid=rid, meta=meta: self._handshaken.put((rid, meta, f.exception())))
        while True:
            try:
                rid, meta, error = self._handshaken.get_nowait()
            except queue.Empty:
                break
            if error is None:
                self._read_history(rid, meta)
            else:
                logger.warning("history read for %s: no handshake with decode (%s); recomputing", rid, error)
                self._failed_recv_reqs.put(rid)

    def _read_history(self, rid: str, meta) -> None:
        try:
            self._read_blocks_for_req(rid, meta)
        except Exception:  # never take the engine down for an optimisation
            logger.exception("history read for %s failed to start; recomputing", rid)
            self._failed_recv_reqs.put(rid)

    def take_notifs(self) -> None:
        """Before vLLM reads the step's notifications (decode): those of prefill's history READs, not vLLM's."""
        take(self._pending_completion_notifs, HISTORY_READ_ID.encode())
