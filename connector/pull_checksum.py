"""Checksums of pulled KV (vLLM-side; no Ray, no ``app``): what a READ landed is checked against
what the engine it read from holds, before it is used.

Push sends the sums in a NIXL notification just before its WRITE (``connector.kv_checksum``). In
pull, prefill never talks to decode's agent, so the sums travel with the request instead:

1. Prefill's scheduler tells its workers, in the step's connector metadata, which prefill legs
   complete their prompt in this step and in which blocks (``SUM_BLOCKS_ATTR``).
2. After the forward pass each worker digests those blocks, one word a block as push does,
   and hands them back in the step's worker metadata (:class:`PulledSums`, one entry per TP rank).
3. The scheduler puts them into the ``kv_transfer_params`` that ``request_finished`` returned for
   the same request in the same step, under ``KV_SUMS_KEY``: vLLM calls ``request_finished`` and
   then ``update_connector_output`` within one ``update_from_output``, and sends the step's
   outputs (which hold that dict) only after it (a seam, ``tests/unit/connector/test_upstream_probes.py``).
4. The orchestrator hands prefill's params to the decode leg as they are. Decode's scheduler passes
   the sums to its workers with the READ (``EXPECTED_ATTR``); each worker keeps its rank's, trimmed
   to the blocks it reads (decode may have the first ones cached), and ``KvSumsCheck`` checks the
   READ when it completes: a mismatch fails the load (vLLM recomputes the prompt), counted as
   ``prefill="kv_mismatch"``.

The other way, the history a conversation turn reads back from decode (``pull_history: upstream``,
vLLM's own READ): a decode leg that keeps its blocks for the next turn sums its prompt's whole
blocks in the step that completes the prompt (steps 1-2 on decode; the partial last block still
changes), and its response carries them under the same key. The orchestrator cuts the offer to the
verified prefix (``connector.params.pull_history_params``) and the next turn's prefill leg brings
the sums along; prefill's workers check what their READ landed, a mismatch makes prefill recompute
the history, and prefill's response reports the turn as ``kv_mismatch`` (``REUSE_REPORT_KEY``).
A decode leg preempted and recomputed sums its blocks again: recomputed KV need not match the
bytes it had.

Checked where both sides' block size and physical blocks per logical block match, between any TP
sizes that ``connector.sum_ranks`` pairs: a sender sums each block in as many chunks as the reader's
TP has ranks a block of its own (it learns the reader's TP size from its config, ``ConnectorSettings.kv_peer_tp_size``:
the orchestrator picks decode late, but every decode replica has the same TP). Elsewhere the reader
logs once and does not check.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from connector.feature import Feature
from connector.faults import injected_fault
from connector.kv_checksum import KvSumsCheck
from connector.settings import DEFAULTS
from connector.sum_ranks import expected_for_rank, parts_for, sender_ranks, why_unpaired
from connector.params import (KEEP_HISTORY_KEY, KV_SUMS_KEY, READ_PLANNED_KEY, REUSE_REPORT_KEY, ReuseReason,
                              ReuseReport, is_decode_leg, is_prefill_leg)

logger = logging.getLogger("vllm.rendezvous")

SUM_BLOCKS_ATTR = "rendezvous_sum_blocks"  # metadata to workers: request id -> logical block ids to sum
EXPECTED_ATTR = "rendezvous_expected_sums"  # metadata to workers: request id -> the sender's KV_SUMS_KEY payload
READ_BACK = "read_back"  # in an EXPECTED_ATTR payload: the READ is a conversation's history (prefill)


@dataclass
class PulledSums(KVConnectorWorkerMetadata):
    """Workers -> scheduler: request id -> TP rank -> [1, blocks, parts] int64 digests (each block
    digested in ``parts`` chunks for a reader of a bigger TP, 1 otherwise:
    connector.sum_ranks), the workers' (TP size, kernel block size, physical blocks per logical
    block), and the prefill legs whose history READ landed wrong."""

    sums: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    layout: tuple[int, int, int] = (1, 0, 1)
    history_mismatched: set[str] = field(default_factory=set)
    parts: int = 1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PulledSums:
        merged = {req: dict(ranks) for req, ranks in self.sums.items()}
        for req, ranks in getattr(other, "sums", {}).items():
            merged.setdefault(req, {}).update(ranks)
        return PulledSums(merged, self.layout, self.history_mismatched | getattr(other, "history_mismatched", set()),
                          self.parts)

    def payload(self, req_id: str) -> dict[str, Any]:
        """What rides in the kv_transfer_params of a response (JSON-safe: the orchestrator may serialize it)."""
        ranks = self.sums[req_id]
        tp, block_size, physical_per_logical = self.layout
        regions = {int(s.shape[0]) for s in ranks.values()}
        return {"tp": tp, "block_size": block_size, "physical_per_logical": physical_per_logical, "parts": self.parts,
                "regions": regions.pop() if len(regions) == 1 else -1,
                "ranks": [base64.b64encode(np.ascontiguousarray(ranks[r], dtype=np.int64).tobytes()).decode()
                          if r in ranks else "" for r in range(tp)]}


def expected_for(payload: dict[str, Any], *, tp: int, rank: int, block_size: int, physical_per_logical: int,
                 offered: int, blocks: int, kv_heads: int, split_heads: bool = True) -> tuple[np.ndarray | None, str | None]:
    """This rank's expected sums for a READ of the last ``blocks`` kernel blocks of the first ``offered``
    logical blocks the sums cover (a prompt's: all of them; a history: the verified prefix), or (None, why not).
    vLLM pairs the blocks read with the remote list's last ones (the reader may have the first ones cached).
    The sender's TP may differ from ours (``tp``): connector.sum_ranks says which of its ranks' sums make ours."""
    sender_tp = int(payload.get("tp") or 0)
    if (payload.get("block_size"), payload.get("physical_per_logical")) != (block_size, physical_per_logical):
        return None, (f"the sender's block size / physical blocks per block {payload.get('block_size')} / "
                      f"{payload.get('physical_per_logical')}, here {block_size} / {physical_per_logical}")
    why_not = why_unpaired(sender_tp, tp, kv_heads, split_heads)
    if why_not:
        return None, why_not
    encoded, regions, parts = payload.get("ranks") or [], int(payload.get("regions", -1)), int(payload.get("parts", 1))
    if regions <= 0 or parts <= 0 or len(encoded) != sender_tp:
        return None, "no sums from the remote ranks this one reads"
    offered *= physical_per_logical
    by_rank = {}
    for sender_rank in sender_ranks(sender_tp, tp, rank):  # decode only the ranks this one reads
        if text := encoded[sender_rank]:
            try:
                sums = np.frombuffer(base64.b64decode(text), dtype=np.int64).reshape(regions, -1, parts)
            except ValueError:
                return None, f"sender rank {sender_rank}'s sums are not {regions} regions of {parts} chunk(s) a block"
            if not 0 < blocks <= offered <= sums.shape[1]:
                return None, f"{blocks} blocks read of {offered} offered, {sums.shape[1]} summed"
            by_rank[sender_rank] = sums[:, offered - blocks:offered]
    return expected_for_rank(by_rank, sender_tp=sender_tp, reader_tp=tp, reader_rank=rank)


@dataclass
class _Leg:
    """A leg whose blocks this engine sums once its prompt is computed."""

    prompt_tokens: int
    whole_blocks_only: bool  # decode keeping a turn's history: its partial last block still changes
    blocks: list[int] = field(default_factory=list)
    summed: bool = False


class PullSumsScheduler(Feature):
    """On the pull scheduler; both roles."""

    UPSTREAM = frozenset({"block_size"})

    def __init__(self, host, enabled: bool = DEFAULTS.kv_checksums) -> None:
        super().__init__(host)
        self._kv_checksums = enabled
        # legs: request -> _Leg, until it finishes; finished: this step's finished legs' params, awaiting
        # their sums; kept: decode legs' sums, awaiting their response; expected: sums for the workers to
        # check READs against; history_mismatched: prefill legs whose history READ landed wrong.
        self._pull_sums = {"legs": {}, "finished": {}, "kept": {}, "expected": {}, "history_mismatched": set()}

    def allocating(self, request) -> None:
        """Before vLLM's update_state_after_alloc (it rewrites the params)."""
        params = request.kv_transfer_params
        if self._kv_checksums and params:
            state, prompt_tokens = self._pull_sums, len(request.prompt_token_ids or ())
            if is_prefill_leg(params):
                state["legs"][request.request_id] = _Leg(prompt_tokens, whole_blocks_only=False)
                if params.get(KV_SUMS_KEY) and params.get("remote_block_ids") and not params.get(READ_PLANNED_KEY):
                    state["expected"][request.request_id] = {**params[KV_SUMS_KEY], READ_BACK: True}
            elif is_decode_leg(params):
                if params.get(KV_SUMS_KEY):
                    state["expected"][request.request_id] = params[KV_SUMS_KEY]
                if params.get(KEEP_HISTORY_KEY):
                    state["legs"][request.request_id] = _Leg(prompt_tokens, whole_blocks_only=True)

    def built(self, meta, scheduler_output) -> None:
        """After vLLM's build_connector_meta: what the workers sum and check in this step."""
        state = self._pull_sums
        state["finished"].clear()  # their step's outputs are gone: sums that did not come are not sent
        if state["expected"]:
            setattr(meta, EXPECTED_ATTR, state["expected"])
            state["expected"] = {}
        legs, completing = state["legs"], {}
        if legs:
            scheduled = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id in legs:
                    legs[new.req_id].blocks = list(new.block_ids[0]) if new.block_ids else []
                    self._completes(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), completing)
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                leg = legs.get(req_id)
                if leg is None:
                    continue
                added = cached.new_block_ids[i]
                if req_id in cached.resumed_req_ids:  # after a preemption: its whole block list, recomputed
                    leg.blocks, leg.summed = list(added[0]) if added is not None else [], False
                    state["kept"].pop(req_id, None)
                elif added is not None:
                    leg.blocks += list(added[0])
                self._completes(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), completing)
        if completing:
            setattr(meta, SUM_BLOCKS_ATTR, completing)

    def _completes(self, req_id: str, computed_after_step: int, completing: dict[str, list[int]]) -> None:
        leg = self._pull_sums["legs"][req_id]
        if leg.summed or computed_after_step < leg.prompt_tokens or not leg.blocks:
            return
        leg.summed = True
        blocks = leg.blocks[:leg.prompt_tokens // self.block_size] if leg.whole_blocks_only else leg.blocks
        if blocks:
            completing[req_id] = blocks

    @staticmethod
    def finishing(request) -> bool:
        """Before vLLM's request_finished (it rewrites the params): whether it is a prefill leg."""
        return is_prefill_leg(request.kv_transfer_params)

    def finished(self, request, prefill_leg: bool, delay: bool, params: Any) -> None:
        """After vLLM's request_finished: sums (or a mismatch) into the params it returned."""
        state, req_id = self._pull_sums, request.request_id
        leg, kept = state["legs"].pop(req_id, None), state["kept"].pop(req_id, None)
        mismatched = req_id in state["history_mismatched"]
        state["history_mismatched"].discard(req_id)
        if not isinstance(params, dict):
            return
        if prefill_leg and mismatched:
            params[REUSE_REPORT_KEY] = ReuseReport(ReuseReason.MISMATCH.value).to_wire()
        if delay and kept is not None:
            params[KV_SUMS_KEY] = kept
        elif delay and leg is not None:
            state["finished"][req_id] = params  # its sums come with this step's worker output

    def output(self, connector_output) -> None:
        """After vLLM's update_connector_output: the workers' sums, into the params of legs that finished."""
        summed = connector_output.kv_connector_worker_meta
        if not isinstance(summed, PulledSums):
            return
        state = self._pull_sums
        state["history_mismatched"] |= summed.history_mismatched
        for req_id in summed.sums:
            params = state["finished"].pop(req_id, None)
            if params is not None:  # the same dict the step's output holds: its response carries the sums
                params[KV_SUMS_KEY] = summed.payload(req_id)
            elif getattr(state["legs"].get(req_id), "whole_blocks_only", False):
                state["kept"][req_id] = summed.payload(req_id)  # for the response when it finishes


class PullSumsWorker(KvSumsCheck):
    """On the pull worker: sums what is asked, checks what it READs."""

    UPSTREAM = KvSumsCheck.UPSTREAM | {"block_size", "_physical_blocks_per_logical_kv_block",
                                       "_logical_to_kernel_block_ids", "transfer_topo"}

    def __init__(self, host, enabled: bool = DEFAULTS.kv_checksums, peer_tp: int = DEFAULTS.kv_peer_tp_size) -> None:
        super().__init__(host, enabled)
        self._kv_peer_tp = peer_tp  # the other role's TP size
        self._to_sum: dict[str, list[int]] | None = None  # this step's legs to digest (SUM_BLOCKS_ATTR)

    def loading(self, metadata) -> None:
        """Before vLLM's start_load_kv: the step's legs to sum, and the sums to check its READs against."""
        self._to_sum = getattr(metadata, SUM_BLOCKS_ATTR, None)
        for req_id, payload in (getattr(metadata, EXPECTED_ATTR, None) or {}).items() if self._kv_checksums else ():
            reading = metadata.reqs_to_recv.get(req_id)
            if (reading is None or reading.remote is None or len(reading.local_block_ids) != 1
                    or not reading.local_block_ids[0]):
                continue  # nothing to READ (all cached), or several KV cache groups
            expected, why_not = expected_for(
                payload, tp=self.world_size, rank=self.tp_rank, block_size=self.block_size,
                physical_per_logical=self._physical_blocks_per_logical_kv_block,
                offered=len(reading.remote.block_ids[0]),  # still logical: vLLM expands them when it READs
                blocks=len(reading.local_block_ids[0]) * self._physical_blocks_per_logical_kv_block,
                kv_heads=self.transfer_topo.total_num_kv_heads, split_heads=not self.transfer_topo.is_mla)
            if expected is not None and self._kv_regions() is not None:
                self._expected()[req_id] = expected
                if payload.get(READ_BACK):
                    self._expected("history_reads")[req_id] = True
            elif why_not:
                self._warn_once("pull", "KV checksums of pulled KV not checked (%s): %s; logged once", req_id, why_not)

    def _reading_history(self, req_id: str, meta) -> bool:
        return self._expected("history_reads").pop(req_id, None) is not None

    def reading(self, req_id, meta) -> None:
        """Before vLLM posts a request's READs."""
        # Test-only fault: READ the prompt's blocks in rotated order, so each lands in its neighbour's
        # slot. Only a READ whose landing is checked: a fault must never make an unchecked wrong answer.
        ids = meta.remote.block_ids if meta.remote is not None else ()
        if injected_fault() == "shift" and req_id in self._expected() and ids and len(ids[0]) > 1:
            meta.remote.block_ids = (list(ids[0][1:]) + list(ids[0][:1]), *ids[1:])
            logger.warning("fault injection: %s's blocks READ into their neighbours' slots", req_id)

    def worker_meta(self) -> PulledSums | None:
        """The step's worker metadata: the sums asked for, and the histories that landed wrong."""
        to_sum, self._to_sum = self._to_sum, None
        mismatched = self._sums.take_history_mismatched()
        if not to_sum and not mismatched:  # most steps: nothing to report
            return None
        # As many chunks a block as the reader's TP has ranks a block of ours (1 when it is not bigger).
        parts = parts_for(self.world_size, self._kv_peer_tp)
        summed = PulledSums(layout=(self.world_size, self.block_size, self._physical_blocks_per_logical_kv_block),
                            history_mismatched=mismatched or set(), parts=parts)
        for req_id, logical in (to_sum or {}).items():
            try:
                kernel = self._logical_to_kernel_block_ids((list(logical),), self._physical_blocks_per_logical_kv_block)[0]
                sums = self.kv_part_sums(kernel, parts)
            except Exception:  # a check is never worth a request
                logger.exception("KV sums of %s not computed", req_id)
                continue
            if sums is not None:
                summed.sums[req_id] = {self.tp_rank: sums.astype(np.int64)}
        return summed if summed.sums or summed.history_mismatched else None
