"""Progressive push: prefill WRITEs each finished chunk of a prompt's KV while the next one computes
(vLLM-side; imports neither Ray nor ``app``).

Upstream's push worker WRITEs a prompt's KV once, when the prefill leg has finished: the whole
transfer follows the whole prefill. With chunked prefill (``max_num_batched_tokens`` below the
prompt) the KV of the first chunks is done steps earlier, and decode's blocks are registered while
prefill computes; so here, after every step that completes full blocks of a leg, the prefill worker
WRITEs those blocks to decode's, and only the last chunk's transfer stays on the critical path.

- **Which blocks, when** (scheduler, :class:`ProgressiveScheduler`): from each step's scheduler
  output, the blocks of a leg that the step completes ((computed + scheduled) // block size), for
  every step but the one that finishes the prompt; they ride in the step's connector metadata
  (``CHUNKS_ATTR``, a :class:`Chunk` per leg).
- **The WRITE** (worker, :class:`ProgressiveWriter`): at the end of the step's forward
  (``wait_for_save``; on a GPU after the step's work, through a device event) the chunk goes to the
  writer thread, which WRITEs it with vLLM's own ``_xfer_blocks_for_req`` into the decode blocks
  the registration lists (prefill's block i is decode's i - (prefill's blocks - decode's): decode
  registered only what it does not hold, e.g. a conversation's history) with a notification of ours
  (``CHUNK_NOTIF``), not vLLM's completion. No registration yet: the chunk waits, and the
  registration's arrival WRITEs everything computed so far in one go.
- **The last WRITE** is vLLM's, after the final chunk, with vLLM's completion notification (one per
  producer rank, as before); it covers only the blocks not yet written, and is posted once every
  chunk WRITE is done, so decode starts only when every block has landed. Its KV sums
  (``connector.kv_checksum``) cover every block.
- **A chunk WRITE that fails** fails the transfer: the last WRITE is not posted and decode is told at
  once (``WONT_WRITE_NOTIF``, as for an aborted leg): it recomputes the prompt (``kv_failed``). With
  several prefill ranks the others may still WRITE, so decode is not told and recomputes at the KV's
  deadline instead. Nothing is ever decoded from part of the KV.

Off unless ``rendezvous_progressive`` (``handoff.progressive``). Only where a block is one kernel block
on both sides, with one KV cache group and no host staging buffer (else upstream's single WRITE,
logged once). Composed into vLLM's push scheduler and worker by ``connector.push_connector``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX, RemoteMeta, ReqMeta
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.faults import injected_fault
from connector.feature import Feature
from connector.params import WRITE_MARGIN_S, is_prefill_leg
from connector.push_deadline import registration_expired
from connector.side_notifs import CHUNK_NOTIF, WONT_WRITE_NOTIF, take
from connector.stages import chunk_notif_id, parse_chunk_landed, send_stamps

logger = logging.getLogger("vllm.rendezvous")

CHUNKS_ATTR = "rendezvous_chunks"  # on the step's connector metadata: leg request id -> Chunk
CHUNK_KEY = CHUNK_NOTIF.decode()  # a chunk WRITE's key among the worker's transfers (connector.stages: its notification)
_STREAM_KEPT_S = 600.0  # a leg's chunks whose last WRITE never came (its registration never did) are dropped after it
_SETTLE_POLL_S = 0.0005  # how often the last WRITE looks whether the chunk WRITEs before it are done


@dataclass(frozen=True)
class Chunk:
    """Scheduler -> worker: blocks of a prefill leg that a step completes."""

    first: int  # position of block_ids[0] in the leg's block table
    block_ids: tuple[int, ...]
    total_blocks: int  # the leg's prompt blocks in all, once it is done
    restart: bool = False  # the leg was preempted: blocks written before may have been freed since


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# ------------------------------------------------------------------------------------------- scheduler side
@dataclass
class _Leg:
    prompt_tokens: int
    blocks: list[int] = field(default_factory=list)
    sent: int = 0  # blocks handed to the worker
    restart: bool = False


class ProgressiveScheduler(Feature):
    """Prefill side: which blocks of each leg a step completes."""

    UPSTREAM = frozenset({"block_size"})

    def __init__(self, host, enabled: bool) -> None:
        super().__init__(host)
        self._enabled = enabled
        self._legs: dict[str, _Leg] = {}

    def allocated(self, request) -> None:
        """After vLLM's update_state_after_alloc (called once, at the first allocation)."""
        if self._enabled and is_prefill_leg(request.kv_transfer_params) and request.num_prompt_tokens > self.block_size:
            self._legs[request.request_id] = _Leg(request.num_prompt_tokens)

    def built(self, meta, scheduler_output) -> None:
        """After vLLM's build_connector_meta: the step's chunks, on its metadata."""
        if self._legs:
            chunks = plan_chunks(self._legs, scheduler_output, self.block_size)
            if chunks:
                setattr(meta, CHUNKS_ATTR, chunks)

    def finished(self, request) -> None:
        self._legs.pop(request.request_id, None)


def plan_chunks(legs: dict[str, _Leg], out, block_size: int) -> dict[str, Chunk]:
    """The blocks of each leg that this step (``out``, vLLM's SchedulerOutput) completes, but for the step that
    finishes its prompt (vLLM's own WRITE follows it). Updates ``legs``: their block tables and what was sent."""
    computed: dict[str, int] = {}
    for new in out.scheduled_new_reqs:
        if (leg := legs.get(new.req_id)) is not None:
            if len(new.block_ids) != 1:
                legs.pop(new.req_id)  # several KV cache groups: upstream's single WRITE
                continue
            leg.blocks, computed[new.req_id] = list(new.block_ids[0]), new.num_computed_tokens
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if (leg := legs.get(req_id)) is None:
            continue
        new_ids = cached.new_block_ids[i]
        if req_id in cached.resumed_req_ids:  # preempted: a new block table, and nothing of it sent
            leg.blocks, leg.sent, leg.restart = list(new_ids[0]) if new_ids else [], 0, True
        elif new_ids:
            leg.blocks.extend(new_ids[0])
        computed[req_id] = cached.num_computed_tokens[i]
    chunks = {}
    for req_id, done_before in computed.items():
        leg = legs[req_id]
        done = done_before + out.num_scheduled_tokens.get(req_id, 0)
        if done >= leg.prompt_tokens:
            continue  # the last chunk: vLLM's WRITE at request_finished covers it
        full = min(done // block_size, len(leg.blocks))
        if full > leg.sent:
            chunks[req_id] = Chunk(leg.sent, tuple(leg.blocks[leg.sent:full]),
                                   blocks_for(leg.prompt_tokens, block_size), leg.restart)
            leg.sent, leg.restart = full, False
    return chunks


# ------------------------------------------------------------------------------------------- worker side
def chunk_pairs(blocks: list[tuple[int, int]], total_blocks: int, decode_blocks: list[int]) -> list[tuple[int, int]]:
    """(prefill block, decode block) for each (position, prefill block) of a leg of ``total_blocks`` that decode
    registered: the two tables pair from the end (decode registers only what it does not hold), as vLLM pairs them
    for its own WRITE."""
    offset = total_blocks - len(decode_blocks)
    return [(p, decode_blocks[i - offset]) for i, p in blocks if 0 <= i - offset < len(decode_blocks)]


def rest_pairs(local: list[int], remote: list[int], written: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """What the last WRITE still moves: vLLM's pairs (prefill's blocks end-trimmed to decode's) not yet written;
    at least the last one, so that it carries the completion notification."""
    pairs = list(zip(local[-len(remote):], remote)) if remote else []
    return [pair for pair in pairs if pair not in written] or pairs[-1:]


@dataclass
class _Stream:
    """Prefill worker: one leg's chunks, from its first until its last WRITE."""

    request_id: str  # prefill's
    total_blocks: int = 0
    pending: list[tuple[int, int]] = field(default_factory=list)  # (position, block) computed, not yet written
    written: set[tuple[int, int]] = field(default_factory=set)  # (prefill block, decode block) WRITten or in flight
    in_flight: set[str] = field(default_factory=set)  # chunk WRITE keys
    writes: int = 0
    failed: bool = False
    closed: bool = False  # no more chunk WRITEs: the leg was aborted, or a chunk failed
    since: float = field(default_factory=time.monotonic)


class WriterTask:
    """Work for the writer thread, queued on vLLM's ``_deferred_push_inbox`` in place of a block list: the writer
    hands it to ``_do_start_push_kv``, whose override (``connector.push_connector``) runs it instead."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.run = run


class ProgressiveWriter(Feature):
    """Prefill side: WRITEs each chunk as it is done; gates and trims vLLM's last WRITE. Decode side: takes the chunk
    notifications out of vLLM's queue."""

    UPSTREAM = frozenset({
        "_pending_d_registrations", "_sending_transfers", "_sending_transfers_lock", "_send_failures",
        "_deferred_push_inbox", "_push_writer_wake", "_push_writer_stop", "_ensure_handshake", "_remote_agents",
        "nixl_wrapper", "_logical_to_kernel_block_ids", "_physical_blocks_per_logical_kv_block", "_as_grouped_block_ids",
        "transfer_topo", "use_host_buffer", "world_size", "_pending_completion_notifs",
    })

    def __init__(self, host, enabled: bool, xfer: Callable[[str, ReqMeta], Any],
                 pop_done: Callable[[dict], tuple[set, set]]) -> None:
        super().__init__(host)
        self._enabled = enabled
        self._xfer, self._pop_done = xfer, pop_done  # vLLM's own WRITE and its poll of transfers, not ours
        self._lock = threading.Lock()  # streams and chunk handles: the writer thread and the main thread
        self._streams: dict[str, _Stream] = {}  # by base request id (prefill's and decode's ids share it)
        self._chunk_transfers: dict[str, list[int]] = {}  # chunk key -> its NIXL handles
        self._chunk_stream: dict[str, str] = {}  # chunk key -> base request id
        self._eligible: bool | None = None
        self._held: dict[str, bytes] = {}  # late-registration fault: base request id -> its registration notif
        self._released: set[str] = set()

    # ---------------------------------------------------------------- main thread
    def saved(self, metadata) -> None:
        """After the step's forward (vLLM's wait_for_save): hand its chunks to the writer thread."""
        chunks = getattr(metadata, CHUNKS_ATTR, None)
        if not chunks or not self._is_eligible():
            return
        done = _step_done_event()
        for req_id, chunk in chunks.items():
            self._on_writer(req_id, lambda r=req_id, c=chunk: self._chunk(r, c, done))

    def _on_writer(self, req_id: str, run: Callable[[], None]) -> None:
        """Run ``run`` on vLLM's writer thread, which owns every push NIXL operation."""
        self._deferred_push_inbox.put((req_id, WriterTask(run), {}))
        self._push_writer_wake.set()

    def loading(self, metadata) -> None:
        """Before vLLM's start_load_kv: legs aborted on prefill get no more chunk WRITEs; a registration held back
        (``late-registration``) goes to vLLM once its leg has finished."""
        for req_id in getattr(metadata, "reqs_not_processed", None) or ():
            with self._lock:
                if (stream := self._streams.get(get_base_request_id(req_id))) is not None:
                    stream.closed = True
        for req_id in getattr(metadata, "push_finished_blocks", None) or ():
            base_id = get_base_request_id(req_id)
            if (notif := self._held.pop(base_id, None)) is not None:
                self._released.add(base_id)
                self._on_writer(req_id, lambda n=notif: self.host._handle_push_reg_notif(n))

    def take_notifs(self) -> None:
        """Decode: the chunk WRITEs that landed, taken out (vLLM must not parse them; its completion is the last),
        and stamped for the request's timeline (each decode rank hears its own: the replica keeps the first)."""
        now = time.time()
        for notif in take(self._pending_completion_notifs, CHUNK_NOTIF):
            if (stamps := parse_chunk_landed(notif, now)) is not None:
                send_stamps(stamps)

    def may_release(self, base_id: str) -> bool:
        """Whether decode may be told that this leg will not be written (connector.push_deadline): not while a chunk
        WRITE may still land. True closes the leg's stream: no chunk WRITE follows."""
        self.poll()
        with self._lock:
            stream = self._streams.get(base_id)
            if stream is None:
                return True
            if stream.in_flight:
                return False
            stream.closed = True
            return True

    def hiding_chunks(self, transfers: dict) -> dict:
        """Before vLLM polls its sending transfers (caller holds their lock): the chunk WRITEs are ours, taken out
        until :meth:`restore`. Only for the instant between their posting and the writer taking their handles."""
        if transfers is not self._sending_transfers:
            return {}
        return {key: transfers.pop(key) for key in [k for k in transfers if k.startswith(CHUNK_KEY)]}

    @staticmethod
    def restore(transfers: dict, hidden: dict) -> None:
        transfers.update(hidden)

    def poll(self) -> None:
        """Release the chunk WRITEs that are done (vLLM's poll: its transfer stats count each WRITE); note failures."""
        if not self._streams:
            return  # every step of every engine: nothing to look at (a stream outlives its chunk handles)
        with self._lock:
            if not self._chunk_transfers:
                return self._drop_stale()
            done, failed = self._pop_done(self._chunk_transfers)
            for key in done | failed:
                stream = self._streams.get(self._chunk_stream.get(key, ""))
                if stream is not None:
                    if key in failed:
                        stream.failed = stream.closed = True
                    if key in done:
                        stream.in_flight.discard(key)
                if key in done:
                    self._chunk_stream.pop(key, None)
            self._drop_stale()

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for base_id, stream in list(self._streams.items()):
            if not stream.in_flight and (stream.closed and not stream.written or now - stream.since > _STREAM_KEPT_S):
                del self._streams[base_id]

    # ---------------------------------------------------------------- writer thread
    def _chunk(self, req_id: str, chunk: Chunk, done) -> None:
        base_id = get_base_request_id(req_id)
        with self._lock:
            stream = self._streams.setdefault(base_id, _Stream(req_id))
            if chunk.restart:  # the old blocks may hold another request's KV by now: the last WRITE redoes all
                stream.written.clear()
                stream.pending.clear()
            stream.total_blocks = chunk.total_blocks
            stream.pending.extend(enumerate(chunk.block_ids, start=chunk.first))
        if done is not None:
            done.synchronize()  # the step's kernels wrote these blocks
        self._write_pending(base_id)

    def registering(self, notif: bytes) -> bool:
        """A registration came, before vLLM takes it: the chunks computed before it, in one WRITE (ahead of vLLM's
        last WRITE, which vLLM may post from this registration). True: held back by the test-only
        ``late-registration`` fault until the leg has finished (:meth:`loading` hands it to vLLM then)."""
        registration = _decoded(notif)
        if registration is None:
            return False  # vLLM logs what is wrong with it
        base_id = get_base_request_id(registration["request_id"])
        if injected_fault() == "late-registration" and self._enabled and base_id not in self._released:
            logger.warning("fault injection: the registration of %s is held until its prefill has finished", base_id)
            self._held[base_id] = notif
            return True
        self._released.discard(base_id)
        self._write_pending(base_id, registration)
        return False

    def _write_pending(self, base_id: str, registration: dict[str, Any] | None = None) -> None:
        registration = registration or self._registration(base_id)
        with self._lock:
            stream = self._streams.get(base_id)
            if registration is None or stream is None or stream.closed or not stream.pending:
                return
            if registration_expired(registration, time.time(), WRITE_MARGIN_S):
                return  # connector.push_deadline: decode may give these blocks away any moment
            engine_id = registration["decode_engine_id"]
            handshake = self._ensure_handshake(engine_id, registration["decode_host"], registration["decode_port"],
                                               registration["decode_tp_size"])
            if handshake is not None:  # it runs on vLLM's executor: these blocks go once it is done
                # With this registration: vLLM may have taken it for its last WRITE meanwhile (then it is not pending).
                handshake.add_done_callback(lambda f: f.exception() is None and self._on_writer(
                    stream.request_id, lambda: self._write_pending(base_id, registration)))
                return
            if self.transfer_topo.get_engine_info(engine_id).remote_physical_blocks_per_logical != 1:
                return  # upstream's single WRITE
            decode_blocks = list(self._as_grouped_block_ids(registration["local_block_ids"])[0])
            pending, stream.pending = stream.pending, []
            pairs = chunk_pairs(pending, stream.total_blocks, decode_blocks)
            if not pairs:
                return  # decode holds these blocks already (a conversation's history)
            key = f"{CHUNK_KEY}{stream.request_id}#{stream.writes}"
            if injected_fault() == "fail-chunk" and stream.writes == 1:
                logger.warning("fault injection: the second chunk WRITE of %s fails", stream.request_id)
                stream.failed = stream.closed = True
                return
            meta = _write_meta([p for p, _ in pairs], [d for _, d in pairs], engine_id,
                               chunk_notif_id(registration["request_id"], stream.writes), self)
            self._xfer(key, meta)  # vLLM's WRITE, with our notification instead of its completion
            with self._sending_transfers_lock:
                handles = self._sending_transfers.pop(key, [])
                submit_failed = key in self._send_failures
                self._send_failures.discard(key)
            stream.writes += 1
            stream.written.update(pairs)
            if submit_failed:
                stream.failed = stream.closed = True
            if handles:
                self._chunk_transfers[key] = handles
                self._chunk_stream[key] = base_id
                stream.in_flight.add(key)
        logger.debug("chunk WRITE %s: %d blocks of %s", key, len(pairs), stream.request_id)

    def _registration(self, base_id: str) -> dict[str, Any] | None:
        """Decode's registration for this leg, left where vLLM's writer finds it for its own WRITE."""
        registrations = self._pending_d_registrations
        for reg_id in list(registrations):
            if get_base_request_id(reg_id) == base_id:
                return registrations.get(reg_id)
        return None

    def before_last_write(self, request_id: str, registration: dict[str, Any]) -> bool:
        """Before vLLM's last WRITE of a leg: wait until its chunk WRITEs are done; False if one failed (then decode is
        told, or left to its deadline, and the last WRITE is not posted)."""
        base_id = get_base_request_id(request_id)
        if base_id not in self._streams:
            return True
        while True:
            self.poll()
            with self._lock:
                stream = self._streams.get(base_id)
                if stream is None or not stream.in_flight:
                    break
            if self._push_writer_stop.wait(_SETTLE_POLL_S) or registration_expired(registration, time.time()):
                return False  # shutting down; or decode has given the blocks away: no WRITE may follow
        if stream is None or not stream.failed:
            return True
        with self._lock:
            self._streams.pop(base_id, None)
        if self.world_size > 1:
            logger.warning("a chunk WRITE of %s failed: no last WRITE; decode recomputes at the KV's deadline "
                           "(another prefill rank may still WRITE its share)", request_id)
            return False
        logger.warning("a chunk WRITE of %s failed: decode is told to recompute the prompt", request_id)
        for agent in (self._remote_agents.get(registration.get("decode_engine_id")) or {}).values():
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=WONT_WRITE_NOTIF + str(registration["request_id"]).encode())
            except Exception:  # decode's deadline recomputes it all the same
                logger.debug("won't-write notice for %s not sent", request_id, exc_info=True)
        return False

    def last_write(self, req_id: str, meta: ReqMeta) -> ReqMeta:
        """vLLM's last WRITE of a leg, less the blocks its chunks wrote (its sums were taken of every block)."""
        with self._lock:
            stream = self._streams.pop(get_base_request_id(req_id), None)
        if stream is None or not stream.written:
            return meta
        local, remote = list(meta.local_block_ids[0]), list(meta.remote.block_ids[0])
        pairs = rest_pairs(local, remote, stream.written)
        logger.info("%s: the last WRITE moves %d of %d blocks; %d went in %d chunk WRITE(s) while prefill ran",
                    req_id, len(pairs), len(remote), len(remote) - len(pairs), stream.writes)
        return _write_meta([p for p, _ in pairs], [d for _, d in pairs], meta.remote.engine_id,
                           meta.remote.request_id, self)

    # ----------------------------------------------------------------
    def _is_eligible(self) -> bool:
        if self._eligible is None:
            why_not = None if self._enabled else "off"
            if why_not is None and (self.use_host_buffer or self._physical_blocks_per_logical_kv_block != 1):
                why_not = "the KV is staged through host memory, or a block is several kernel blocks"
            if why_not not in (None, "off"):
                logger.warning("progressive push off for this engine: %s", why_not)
            self._eligible = why_not is None
        return self._eligible


def _decoded(notif: bytes) -> dict[str, Any] | None:
    try:
        registration = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX):])
    except Exception:
        return None
    ok = isinstance(registration, dict) and isinstance(registration.get("request_id"), str)
    return registration if ok and "local_block_ids" in registration else None


def _write_meta(local: list[int], remote: list[int], engine_id: str, remote_request_id: str, worker) -> ReqMeta:
    """A WRITE of these blocks, built as vLLM's push worker builds its own (``_do_start_push_kv``)."""
    logical_local = (list(local),)
    return ReqMeta(
        local_block_ids=logical_local,
        local_physical_block_ids=worker._logical_to_kernel_block_ids(logical_local, 1),
        tp_size=worker.world_size,
        remote=RemoteMeta(block_ids=(list(remote),), host="", port=0, engine_id=engine_id, request_id=remote_request_id),
    )


def _step_done_event():
    """On a GPU: an event after the step's work, so that the writer thread WRITEs blocks the forward has written
    (the forward returns before its kernels are done). On a CPU the forward is done when it returns: None."""
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    event = torch.cuda.Event()
    event.record()
    return event
