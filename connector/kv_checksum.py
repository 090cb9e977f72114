"""Checksums of pushed KV (vLLM-side; no Ray, no ``app``): a WRITE that lands wrong bytes is caught
before decode computes with them.

The worst failure of NIXL P/D is not a crash but a 200 with garbage: KV written to the wrong blocks,
a mapping mismatch, a partial write counted as complete. Just before each WRITE the prefill worker
digests every block it sends (one int64 word a block: its layer regions' sums of bytes, weighed,
``KvSumsCheck.kv_digest_job``; on the device that holds them) and sends the digests to its peer
decode worker in one NIXL notification (``KV_SUMS_NOTIF``; the same endpoint carries the WRITE's
completion afterwards, so they come first). When decode's worker sees the receive complete it
digests what landed in its own blocks (on a GPU without waiting for the device: the receive is
held until the digests are in) and compares. A mismatch fails the load the way vLLM's own transfer failures do: the blocks are
reported invalid and vLLM recomputes the prompt on decode (``kv_load_failure_policy: recompute``),
so the client still gets a correct answer; decode's replica counts it as ``prefill="kv_mismatch"``
(a datagram, ``connector.stages``) and the worker logs which descriptors disagreed.

The other way too: a conversation turn's history that prefill READs back from decode
(``connector.push_reuse``). Decode adds the sums of the blocks it offers to its push registration;
prefill checks what its READ landed, and on a mismatch recomputes the history (vLLM's failed-load
path again) and reports the turn as ``kv_mismatch`` (``ReuseReason.MISMATCH``).

Catches: flipped or stale bytes in any block of any layer, a WRITE into shifted blocks, a write
that never happened. Not a permutation of words inside one descriptor (a sum is order-blind).
Between different TP sizes too (``connector.sum_ranks``): a prefill rank that WRITEs to several
decode ranks sums each block in as many chunks and sends each rank its chunk's sums; a decode rank
that several prefill ranks WRITE to adds up their sums. Checked where block sizes and physical
blocks per logical block match, with one KV cache group (KV staged through host memory is checked
in the host buffers NIXL moves); elsewhere the sums are not sent and nothing is checked (logged once). A history read back likewise: each decode rank
registers its offer alone, with the sums of its share, and prefill combines them. Pull mode's READs, a prompt's and a
history's read back, are checked the same way on landing (``KvSumsCheck``); the sums travel with
the requests instead (``connector.pull_checksum``).

Fault injection, for tests and benchmarks only: ``connector.faults``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.faults import injected_fault
from connector.feature import Feature
from connector.kv_digest import DigestJob, digest_job
from connector.push_reuse import OFFER_KEY, ReuseOffers
from connector.settings import DEFAULTS
from connector.side_notifs import HISTORY_READ_ID, KV_SUMS_NOTIF, take
from connector.stages import DecodeKvStamps, KvFailure, send_stamps
from connector.sum_ranks import expected_for_rank, parts_for, sender_ranks, why_unpaired

logger = logging.getLogger("vllm.rendezvous")

_EXPECTED_KEPT = 4096  # sums of receives still in flight; older ones (aborted, expired) are dropped
SUMS_WAIT_S = 2.0  # how long a receive that landed before its senders' sums waits for them (then: unchecked)


class KvSums(msgspec.Struct, frozen=True):
    """Prefill worker -> each decode worker it WRITEs to, just before the WRITE."""

    request_id: str  # decode's
    regions: int  # 1: a block's layer regions are folded into its digest (KvSumsCheck.kv_digest_job)
    sums: bytes  # int64 digests, [1, blocks], blocks in decode's order: of the chunk of our blocks this rank gets
    producers: int = 1  # prefill ranks that WRITE into each of decode's blocks: their sums add up (sum_ranks)


@dataclass
class _Offered:
    """Prefill: the sums of a history decode offers, from each decode rank's registration."""

    block_ids: list[int]
    decode_tp: int
    by_rank: dict[int, np.ndarray] = field(default_factory=dict)  # decode rank -> [1, blocks, parts] digests


_UNMAPPED = object()  # ChecksumState.regions before the KV cache was looked at


@dataclass
class ChecksumState:
    """A worker's checksum state (held by its KvSumsCheck feature)."""

    regions: Any = _UNMAPPED  # per layer region a [blocks, words] int64 view of what NIXL moves; None: not covered
    warned: set = field(default_factory=set)  # kinds of transfer logged once as unchecked
    expected: OrderedDict = field(default_factory=OrderedDict)  # request -> its sender's digests (or _Received)
    history_sums: OrderedDict = field(default_factory=OrderedDict)  # prefill: turn -> _Offered
    history_reads: OrderedDict = field(default_factory=OrderedDict)  # pull prefill: READs that are histories
    awaited: dict = field(default_factory=dict)  # landed before its senders' sums: request -> since (monotonic)
    checking: dict = field(default_factory=dict)  # landed, being digested: request -> _Checking
    history_mismatched: set = field(default_factory=set)  # prefill: histories that landed wrong, for the scheduler

    def take_history_mismatched(self) -> set:
        taken, self.history_mismatched = self.history_mismatched, set()
        return taken


@dataclass
class _Checking:
    """A receive whose landed blocks are being digested, to compare with ``expected``."""

    expected: np.ndarray  # [1, blocks]
    job: DigestJob
    history: bool


@dataclass
class _Received:
    """Decode: the sums of one receive, as its producer ranks' notifications come in."""

    producers: int
    sums: list[np.ndarray] = field(default_factory=list)


def mismatches(expected: np.ndarray, got: np.ndarray) -> list[tuple[int, int]]:
    """(region, block position) pairs whose sums differ; every pair if the shapes do."""
    if expected.shape != got.shape:
        return [(r, b) for r in range(max(expected.shape[0], got.shape[0])) for b in range(max(expected.shape[1], 1))]
    return [(int(r), int(b)) for r, b in zip(*np.nonzero(expected != got))]


class KvSumsCheck(Feature):
    """On a NIXL worker: digests of blocks, and the check of a receive against the digests its sender
    computed (``_expected``, filled by the mode's variant: :class:`KvChecksums` for push,
    ``connector.pull_checksum.PullSumsWorker`` for pull)."""

    UPSTREAM = frozenset({"src_blocks_data", "num_blocks", "num_regions", "host_xfer_buffers", "device_kv_caches",
                          "use_host_buffer", "_has_mamba", "_is_hma_required", "_recving_transfers",
                          "_recving_metadata", "world_size", "tp_rank"})

    def __init__(self, host, enabled: bool = DEFAULTS.kv_checksums) -> None:
        super().__init__(host)
        self._kv_checksums, self._sums = enabled, ChecksumState()

    def _kv_regions(self):
        """Per descriptor region: a [num_blocks, block bytes / 8] int64 view of the memory NIXL transfers;
        None where descriptors do not pair one to one (see the module docstring)."""
        if self._sums.regions is not _UNMAPPED:
            return self._sums.regions
        if not self._kv_checksums:
            self._sums.regions = None
            return None
        regions = None
        try:
            regions = self._build_kv_regions()
        except Exception:  # never let a safety check take the engine down
            logger.exception("KV checksums off: cannot map the KV cache")
        if regions is None:
            logger.warning("KV checksums off for this engine: its KV layout is not one they cover")
        self._sums.regions = regions
        return regions

    def _build_kv_regions(self):
        import torch

        if self._has_mamba or getattr(self, "_is_hma_required", False):
            return None
        blocks_data, num_blocks = np.asarray(self.src_blocks_data), self.num_blocks
        if num_blocks < 2 or len(blocks_data) != self.num_regions * num_blocks:
            return None
        # What NIXL moves: the host staging buffers where KV goes through host memory (kv_buffer_device
        # "cpu" on a device that NIXL cannot register, e.g. Neuron). A receive is checked there, before
        # vLLM copies it to the device; the copies between device and host are vLLM's and not checked.
        registered = self.host_xfer_buffers if self.use_host_buffer else self.device_kv_caches
        storages = {}
        for cache in registered.values():
            storage = cache.untyped_storage()
            storages[storage.data_ptr()] = (storage, cache.device)
        regions = []
        for k in range(self.num_regions):
            rows = blocks_data[k * num_blocks:(k + 1) * num_blocks]
            base, length = int(rows[0][0]), int(rows[0][1])
            stride = int(rows[1][0]) - base
            if length % 8 or stride % 8 or int(rows[-1][0]) != base + (num_blocks - 1) * stride:
                return None
            owner = [(ptr, s, d) for ptr, (s, d) in storages.items() if ptr <= base and base + (num_blocks - 1) * stride
                     + length <= ptr + s.nbytes()]
            if len(owner) != 1:
                return None
            ptr, storage, device = owner[0]
            if (base - ptr) % 8:
                return None
            flat = torch.empty(0, dtype=torch.int64, device=device).set_(storage, 0, (storage.nbytes() // 8,), (1,))
            regions.append(flat.as_strided((num_blocks, length // 8), (stride // 8, 1), (base - ptr) // 8))
        return regions

    def kv_sums(self, block_ids) -> np.ndarray | None:
        """[1, len(block_ids)] int64 digests of these (kernel) blocks' bytes, or None if not covered."""
        sums = self.kv_part_sums(block_ids)
        return None if sums is None else sums[:, :, 0]

    def kv_part_sums(self, block_ids, parts: int = 1) -> np.ndarray | None:
        """[1, len(block_ids), parts] int64 digests of each block's ``parts`` equal chunks (the KV heads
        of as many ranks of a bigger TP: connector.sum_ranks), or None if not covered. Synchronous:
        for where the caller must have them now (before a WRITE, in a registration, in a step's output)."""
        job = self.kv_digest_job(block_ids, parts)
        return None if job is None else job.result()

    def kv_digest_job(self, block_ids, parts: int = 1) -> DigestJob | None:
        """The digests of :meth:`kv_part_sums` (one word a block: connector.kv_digest), computed without making
        the caller wait for the device (:meth:`DigestJob.ready` says when they are in), or None if not covered."""
        regions = self._kv_regions()
        return None if regions is None else digest_job(regions, block_ids, parts)

    def _warn_once(self, what: object, message: str, *args) -> None:
        """A warning logged once per worker for ``what``: why a kind of transfer goes unchecked (it stays so)."""
        warned = self._sums.warned
        if what not in warned:
            warned.add(what)
            logger.warning(message, *args)

    def _expected(self, table: str = "expected") -> OrderedDict:
        """A table of :class:`ChecksumState` kept until its receive lands (by request, or turn for history
        reads), the oldest dropped: their receives were aborted or expired."""
        expected = getattr(self._sums, table)
        while len(expected) > _EXPECTED_KEPT:
            expected.popitem(last=False)
        return expected

    def landed(self, transfers, done: set, failed: set) -> tuple[set, set]:
        """After vLLM's _pop_done_transfers: of the receives it found done, hold those whose check is not
        finished yet, and move those that landed wrong to ``failed`` (vLLM then recomputes them)."""
        if transfers is not self._recving_transfers:
            return done, failed
        # Landed before every sender's sums: looked at again each step, for SUMS_WAIT_S at most. Landed and
        # being summed (on a GPU: on a side stream): looked at again each step until the digests are in.
        awaited, checking = self._sums.awaited, self._sums.checking
        done |= set(awaited) | set(checking)
        now = time.monotonic()
        for req_id in list(done):
            meta = self._recving_metadata.get(req_id)
            if meta is None or len(meta.local_physical_block_ids) != 1:
                awaited.pop(req_id, None)
                checking.pop(req_id, None)
                continue
            history = self._reading_history(req_id, meta) if req_id not in checking else checking[req_id].history
            if req_id not in checking:
                if self._sums_due(req_id, history) and now - awaited.setdefault(req_id, now) < SUMS_WAIT_S:
                    done.discard(req_id)
                    continue
                awaited.pop(req_id, None)
                started = self._start_check(req_id, meta, history)
                if started is None:
                    continue  # nothing to check against
                checking[req_id] = started
            if not checking[req_id].job.ready():
                done.discard(req_id)  # the device is still summing: vLLM sees the receive at a later step
                continue
            if self._landed_right(req_id, checking.pop(req_id)):
                continue
            done.discard(req_id)
            failed.add(req_id)  # vLLM reports it failed and its blocks invalid (get_transfer_results)
            if history:  # prefill: the scheduler reports the turn (ReuseReason.MISMATCH)
                self._sums.history_mismatched.add(req_id)
            else:  # decode: its replica counts the request (prefill="kv_mismatch")
                send_stamps(DecodeKvStamps(req_id, failed=KvFailure.MISMATCH.value))
        return done, failed

    def _reading_history(self, req_id: str, meta) -> bool:
        """Whether this receive is a conversation's history read back by prefill (not a prompt's KV on decode)."""
        return False

    def _sums_due(self, req_id: str, history: bool) -> bool:
        """Whether some of this receive's senders' sums are still on their way (then the check waits for them)."""
        return False

    def _expected_sums(self, req_id: str, meta, history: bool) -> np.ndarray | None:
        """The sender's digests of what this receive should have landed, in the order of its blocks."""
        return self._expected().pop(req_id, None)

    def _start_check(self, req_id: str, meta, history: bool) -> _Checking | None:
        """The digests of what this receive landed, started (not waited for), and what they should be;
        None if there is nothing to check against."""
        blocks = list(meta.local_physical_block_ids[0])
        expected = self._expected_sums(req_id, meta, history)
        if expected is None:
            return None
        fault = injected_fault()
        if blocks and self._kv_regions() and fault == ("flip-history" if history else "flip"):
            self._kv_regions()[0][blocks[0], 0] ^= 0xFF
            logger.warning("fault injection: a byte of %s's first block flipped after it landed", req_id)
        job = self.kv_digest_job(blocks)
        return None if job is None else _Checking(expected, job, history)

    def _landed_right(self, req_id: str, check: _Checking) -> bool:
        """Whether the KV this receive landed is what the sender digested (its digests are ready)."""
        got = check.job.result()[:, :, 0]
        wrong = mismatches(check.expected, got)
        if wrong:
            logger.warning("KV of %s landed wrong%s: %d of %d blocks' digests differ, first at block positions %s; %s",
                           req_id, " (history read back from decode)" if check.history else "", len(wrong),
                           check.expected.size, [block for _, block in wrong[:3]],
                           "prefill recomputes the history" if check.history else "decode recomputes the prompt")
        return not wrong


class KvChecksums(KvSumsCheck):
    """On the push worker; both roles."""

    UPSTREAM = KvSumsCheck.UPSTREAM | {"transfer_topo", "tp_mappings", "_remote_agents", "nixl_wrapper",
                                       "_physical_blocks_per_logical_kv_block", "_logical_to_kernel_block_ids",
                                       "_pending_completion_notifs"}

    # ---------------------------------------------------------------- prefill: sums, then the WRITE
    def writing(self, req_id, meta) -> bool:
        """Before vLLM's WRITE (``_xfer_blocks_for_req``): send the sums; False to skip the WRITE (a test fault)."""
        remote = meta.remote
        if injected_fault() == "drop-rank" and self.world_size > 1 and self.tp_rank == self.world_size - 1:
            logger.warning("fault injection: TP rank %d does not WRITE its share of %s", self.tp_rank, req_id)
            return False
        try:
            self._send_kv_sums(meta)
        except Exception:  # a check is never worth a transfer
            logger.exception("KV sums for %s not sent", req_id)
        if injected_fault() == "shift" and remote.block_ids and len(remote.block_ids[0]) > 1:
            ids = list(remote.block_ids[0])
            remote.block_ids = (ids[1:] + ids[:1], *remote.block_ids[1:])
            logger.warning("fault injection: %s's blocks WRITten into their neighbours' slots", req_id)
        return True

    def _send_kv_sums(self, meta) -> None:
        remote = meta.remote
        targets, why_not = self._sum_targets(meta)
        if why_not:
            self._warn_once(("push", remote.engine_id), "KV checksums off for pushes to engine %s: %s",
                            remote.engine_id, why_not)
            return
        # Decode allocated only what it did not have cached: the blocks pair from the end.
        wanted = len(remote.block_ids[0]) * self._physical_blocks_per_logical_kv_block
        local = list(meta.local_physical_block_ids[0])[-wanted:] if wanted else []
        sums = self.kv_part_sums(local, len(targets)) if local else None
        if sums is None:
            return
        remote_tp = self.transfer_topo.get_engine_info(remote.engine_id).remote_tp_size
        producers = max(1, self.world_size // remote_tp)  # prefill ranks whose sums add up to a decode rank's
        for chunk, agent in targets:
            payload = KvSums(remote.request_id, sums.shape[0], np.ascontiguousarray(sums[:, :, chunk]).tobytes(),
                             producers)
            self.nixl_wrapper.send_notif(agent, notif_msg=KV_SUMS_NOTIF + msgspec.msgpack.encode(payload))

    def _sum_targets(self, meta) -> tuple[list[tuple[int, str]], str | None]:
        """(chunk of our blocks it receives, agent) for each decode rank our WRITE goes to (vLLM's TP
        mapping: all_source_ranks, chunk rank_to_attention_slot), or why sums cannot be paired there."""
        remote, topo = meta.remote, self.transfer_topo
        info = topo.get_engine_info(remote.engine_id)
        if len(meta.local_physical_block_ids) != 1 or len(remote.block_ids) != 1:
            return [], "several KV cache groups"
        if (topo.block_size_ratio(info.remote_block_size) != 1
                or info.remote_physical_blocks_per_logical != self._physical_blocks_per_logical_kv_block):
            return [], "the block sizes differ"
        why_not = why_unpaired(self.world_size, info.remote_tp_size, topo.total_num_kv_heads, not topo.is_mla)
        if why_not:
            return [], why_not
        plan = self.tp_mappings[remote.engine_id]
        ranks = list(plan.all_source_ranks)
        if len(ranks) != parts_for(self.world_size, info.remote_tp_size):
            return [], f"vLLM writes to decode ranks {ranks}, not one per chunk"
        # vLLM keys a remote engine's agents by (pp rank, tp rank).
        agents = {(key[-1] if isinstance(key, tuple) else key): name
                  for key, name in (self._remote_agents.get(remote.engine_id) or {}).items()}
        if any(rank not in agents for rank in ranks):
            return [], f"no agent of decode rank(s) {[r for r in ranks if r not in agents]}"
        return [(plan.rank_to_attention_slot.get(rank, 0) if len(ranks) > 1 else 0, agents[rank])
                for rank in ranks], None

    # ---------------------------------------------------------------- prefill: what its history READ should land
    def _reading_history(self, req_id: str, meta) -> bool:
        remote = getattr(meta, "remote", None)
        return remote is not None and remote.request_id == HISTORY_READ_ID

    def _expected_sums(self, req_id: str, meta, history: bool) -> np.ndarray | None:
        if not history:
            received = self._expected().pop(req_id, None)
            if (received is None or len(received.sums) != received.producers
                    or len({sums.shape for sums in received.sums}) != 1):
                return None  # a sender's sums were not sent (or are of other blocks): nothing to check against
            return np.sum(received.sums, axis=0, dtype=np.int64)
        offered = self._sums.history_sums.pop(_history_key(req_id), None)
        if offered is None:
            return None
        column = {block: i for i, block in enumerate(offered.block_ids)}
        read = list(meta.remote.block_ids[0])
        if len(read) != len(meta.local_physical_block_ids[0]) or any(b not in column for b in read):
            return None  # not the one-to-one READ of offered blocks the sums describe
        columns = [column[b] for b in read]
        expected, _ = expected_for_rank({rank: sums[:, columns] for rank, sums in offered.by_rank.items()},
                                        sender_tp=offered.decode_tp, reader_tp=self.world_size, reader_rank=self.tp_rank)
        return expected  # None where a decode rank's offer did not come: nothing to check against

    def _sums_due(self, req_id: str, history: bool) -> bool:
        # Each decode rank registers alone, and the READ starts on the first offer: a lagging rank's offer, with
        # its sums, can come after the READ landed (seen: decode TP 3, on a busy box). Unchecked is not an answer.
        offered = self._sums.history_sums.get(_history_key(req_id)) if history else None
        if offered is None:
            return False
        return not set(sender_ranks(offered.decode_tp, self.world_size, self.tp_rank)) <= set(offered.by_rank)

    # ---------------------------------------------------------------- decode: sums of the history it offers
    def registering(self, req_id, reg_data) -> None:
        """Before vLLM sends decode's registration: add the sums of the history it offers."""
        offer = reg_data.get(OFFER_KEY)
        if offer and offer.get("block_ids"):
            try:
                ids = self._logical_to_kernel_block_ids((list(offer["block_ids"]),),
                                                        self._physical_blocks_per_logical_kv_block)[0]
                # In as many chunks a block as prefill has ranks a block of ours (connector.sum_ranks).
                parts = parts_for(self.world_size, int(reg_data.get("remote_tp_size") or 1))
                sums = self.kv_part_sums(ids, parts)
                if sums is not None:
                    offer.update(sums=sums.tobytes(), sum_regions=sums.shape[0], sum_parts=parts, sum_rank=self.tp_rank)
            except Exception:  # the offer stands without its sums
                logger.exception("sums of %s's history offer not computed", req_id)

    # ---------------------------------------------------------------- prefill: keep the offer's sums
    def on_registration(self, notif: bytes) -> None:
        """A registration came (prefill's writer thread): keep the sums of the history it offers."""
        try:
            registration = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
            offer = registration.get(OFFER_KEY) or {}
            if offer.get("sums"):
                self._keep_offered_sums(registration, offer)
        except Exception:  # vLLM's handler says what is wrong with the payload
            pass

    def _keep_offered_sums(self, registration: dict, offer: dict) -> None:
        """Each decode rank registers alone, with the sums of its own share of the offered blocks."""
        decode_tp, topo = int(registration.get("decode_tp_size") or 1), self.transfer_topo
        why_not = why_unpaired(decode_tp, self.world_size, topo.total_num_kv_heads, not topo.is_mla)
        if why_not:
            self._warn_once("history", "KV checksums off for histories read back from decode: %s; logged once", why_not)
            return
        sums = np.frombuffer(offer["sums"], dtype=np.int64).reshape(offer["sum_regions"], -1, offer.get("sum_parts", 1))
        # Written here (the writer thread), popped by the main thread: single dict operations only.
        kept, key = self._expected("history_sums"), _history_key(registration["request_id"])
        offered = kept.get(key)
        if offered is None or offered.block_ids != list(offer["block_ids"]):
            offered = kept[key] = _Offered(list(offer["block_ids"]), decode_tp)
        offered.by_rank[int(offer.get("sum_rank", 0))] = sums

    def worker_meta(self, meta: ReuseOffers | None) -> ReuseOffers | None:
        """The step's worker metadata (the reuse offers), with the histories that landed wrong."""
        mismatched = self._sums.take_history_mismatched()
        if not mismatched:
            return meta
        meta = meta if isinstance(meta, ReuseOffers) else ReuseOffers()
        meta.mismatched |= mismatched
        return meta

    # ---------------------------------------------------------------- decode: keep the sums (checked on landing)
    def take_notifs(self) -> None:
        """Before vLLM reads the step's notifications (decode): prefill's sums."""
        expected = self._expected()
        for notif in take(self._pending_completion_notifs, KV_SUMS_NOTIF):
            try:
                sums = msgspec.msgpack.decode(notif[len(KV_SUMS_NOTIF):], type=KvSums)
            except msgspec.DecodeError:
                logger.warning("malformed KV sums notification dropped")
                continue
            received = expected.setdefault(sums.request_id, _Received(sums.producers))
            received.sums.append(np.frombuffer(sums.sums, dtype=np.int64).reshape(sums.regions, -1))


def _history_key(request_id: str) -> str:
    """Decode's offer and prefill's READ of the same turn share the base request id."""
    return "history:" + get_base_request_id(request_id)
