"""What the engines see of a request's stages (vLLM-side; no Ray, no ``app``).

The orchestrator times every stage of a request it can see (app/request/timeline.py); what
happens inside the engines it cannot. Their connector schedulers see it:

* prefill: the leg's arrival at the engine (``Request.arrival_time``, stamped by vLLM's
  frontend), its first allocation (scheduled to compute) and its finish. They travel back
  in the ``kv_transfer_params`` of prefill's response under ``STAGES_KEY``, as the reuse
  report does.
* decode: when the request's blocks were allocated for remote KV (push: registered with
  prefill; pull: its READ started), when the KV had landed (the worker reported the
  receive complete) and when the step that computes its first token was scheduled; or that
  the KV never landed: the load failed and vLLM recomputes the prompt on decode
  (:class:`KvFailure`: past the KV's deadline, or a failed transfer). Decode's response carries no params when streamed, so these go to the
  serving replica as datagrams, on an abstract UNIX socket named after that process
  (:func:`stamps_address`; the replica names itself in ``STAMPS_PID_ENV`` before its engine
  starts); a replica that does not listen loses nothing but the stamps.
* push's WRITE start: only the prefill worker sees it. It sends decode's workers one small
  NIXL notification (``WRITE_STARTED_NOTIF``) just before the WRITE, and decode's worker
  passes the time on to its replica as above (:class:`WriteClock`). One UCX message per
  request and producer rank; one that arrives after the KV is only a stamp lost.

Wall clock: the orchestrator compares them with its own stamps (same host, or NTP).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import Any

from connector.feature import Feature
from connector.params import STAGES_KEY, is_decode_leg, is_prefill_leg, kv_timeout_of
from connector.side_notifs import CHUNK_NOTIF, WRITE_STARTED_NOTIF, take

logger = logging.getLogger("vllm.rendezvous")


class KvFailure(str, Enum):
    """Why a decode engine recomputed a prompt whose KV it had asked for (the load failed)."""

    DEADLINE = "kv_deadline"  # no WRITE before the registration's deadline (connector.push_deadline), no READ
    # done by its deadline (connector.pull_deadline)
    FAILED = "kv_failed"  # the transfer (or its handshake) failed
    MISMATCH = "kv_mismatch"  # push: it landed, but not the bytes prefill sent (connector.kv_checksum)


# A failure this close to the request's push deadline is the deadline's (it fires at the expiry).
_DEADLINE_SLACK_S = 1.0


@dataclass(frozen=True)
class DecodeKvStamps:
    """Decode engine -> its replica: when one request's remote KV was asked for, pushed, landed.
    The scheduler sends ``requested`` and ``landed``, the worker ``write_started``: each datagram
    carries what its sender knows."""

    request_id: str  # the engine's id (connector.params.external_request_id gives the replica's)
    requested: float | None = None  # push: blocks registered with prefill; pull: READ started
    landed: float | None = None  # the worker reported the receive complete
    scheduled: float | None = None  # then the step that computes its first token was scheduled
    write_started: float | None = None  # push: the prefill worker began its WRITE (its clock)
    failed: str | None = None  # a KvFailure value: the KV never landed, decode recomputes the prompt
    chunk_landed: float | None = None  # progressive push: a chunk WRITE landed (connector.progressive)...
    chunk: int | None = None  # ... its index in the leg's chunk WRITEs (0 first)

    def to_wire(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_wire(cls, data: bytes) -> DecodeKvStamps | None:
        try:
            raw = json.loads(data)
            request_id = raw["request_id"]
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(request_id, str):
            return None
        failed = raw.get("failed")
        return cls(request_id, *(_seconds(raw.get(name)) for name in ("requested", "landed", "scheduled", "write_started")),
                   failed=failed if failed in {f.value for f in KvFailure} else None,
                   chunk_landed=_seconds(raw.get("chunk_landed")), chunk=_tokens(raw.get("chunk")))


# The serving replica's pid, set by the replica before its engine starts (the engine's
# processes inherit it). Unset: the engine's parent (vLLM's EngineCore is the replica's child).
STAMPS_PID_ENV = "RENDEZVOUS_STAMPS_PID"


def stamps_address(replica_pid: int) -> bytes:
    """Abstract UNIX socket on which the serving process ``replica_pid`` hears its engine."""
    return b"\0rendezvous-stamps-%d" % replica_pid


def _stamps_target() -> bytes:
    pid = os.environ.get(STAMPS_PID_ENV, "")
    return stamps_address(int(pid) if pid.isdigit() else os.getppid())


class StampSender:
    """A non-blocking datagram socket to the serving replica, opened on first use."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = None

    def send(self, stamps: DecodeKvStamps) -> None:
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._socket.setblocking(False)
        try:
            self._socket.sendto(stamps.to_wire(), _stamps_target())
        except OSError:  # nobody listens (not under our replica): the stamps are only lost
            pass


# One per engine process: the scheduler and the worker (and its writer thread) all send through it.
send_stamps = StampSender().send


class StageClock:
    """On the connector scheduler (push or pull, either role): when each leg reached each stage. Reads
    nothing of vLLM's scheduler: what it needs comes with each call."""

    def __init__(self, kv_timeout_s: float | None) -> None:
        self._kv_timeout_s = kv_timeout_s  # tells a failure at the deadline from another
        # started: prefill leg -> (first allocation, prompt tokens, tokens it computes: less what it reads from
        # elsewhere, a conversation's history); requested: decode request -> when blocks were allocated for remote
        # KV; timeout: its KV deadline (seconds); blocks: decode request -> its block ids, to tell a failed load
        # (vLLM reports invalid blocks) from a landed one; landed: decode requests whose KV landed, not yet scheduled.
        self._stage_state: dict[str, Any] = {"started": {}, "requested": {}, "blocks": {}, "timeout": {}, "landed": set()}

    @staticmethod
    def before_alloc(request) -> tuple[Any, bool]:
        """Before vLLM's update_state_after_alloc: the request's params and whether it is a decode leg (vLLM
        clears the flag)."""
        kv_params = request.kv_transfer_params
        return kv_params, is_decode_leg(kv_params)

    def allocated(self, request, blocks, num_external_tokens, before: tuple[Any, bool]) -> None:
        kv_params, decode_leg = before
        if is_prefill_leg(request.kv_transfer_params):
            prompt = request.num_prompt_tokens
            self._stage_state["started"].setdefault(request.request_id, (time.time(), prompt, prompt - num_external_tokens))
        elif decode_leg and num_external_tokens > 0:
            self._stage_state["requested"].setdefault(request.request_id, time.time())
            self._stage_state["timeout"][request.request_id] = kv_timeout_of(kv_params, self._kv_timeout_s)
            self._stage_state["blocks"][request.request_id] = {b for group in blocks.get_block_ids() for b in group}

    def output(self, connector_output) -> None:
        """After vLLM's update_connector_output: decode's KV landed, or failed."""
        state, now = self._stage_state, time.time()
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        for request_id in connector_output.finished_recving or ():
            at = state["requested"].pop(request_id, None)
            blocks = state["blocks"].pop(request_id, set())
            timeout_s = state["timeout"].pop(request_id, None)  # the request's KV deadline (connector.*_deadline)
            if at is None:
                continue
            if blocks & invalid:
                past_deadline = timeout_s is not None and now >= at + timeout_s - _DEADLINE_SLACK_S
                failure = KvFailure.DEADLINE if past_deadline else KvFailure.FAILED
                send_stamps(DecodeKvStamps(request_id, requested=at, failed=failure.value))
            else:
                send_stamps(DecodeKvStamps(request_id, requested=at, landed=now))
                state["landed"].add(request_id)

    def built(self, scheduler_output) -> None:
        """In vLLM's build_connector_meta (before the step runs): a request whose KV landed is scheduled to compute
        its first token (its last prompt token: vLLM loads the others)."""
        landed = self._stage_state["landed"]
        if landed:
            scheduled, now = landed & scheduler_output.num_scheduled_tokens.keys(), time.time()
            for request_id in scheduled:
                send_stamps(DecodeKvStamps(request_id, scheduled=now))
            landed -= scheduled

    def finishing(self, request) -> PrefillStages | None:
        """Before vLLM's request_finished (which rewrites the params): a prefill leg's stages."""
        state = self._stage_state
        started, prompt, computed = state["started"].pop(request.request_id, None) or (None, None, None)
        state["requested"].pop(request.request_id, None)  # never landed (aborted, expired)
        state["blocks"].pop(request.request_id, None)
        state["timeout"].pop(request.request_id, None)
        state["landed"].discard(request.request_id)
        if not is_prefill_leg(request.kv_transfer_params):
            return None
        return PrefillStages(getattr(request, "arrival_time", None), started, None, prompt, computed)

    @staticmethod
    def finished(stages: PrefillStages | None, params: Any) -> None:
        """After vLLM's request_finished: the stages go into the params it returned (prefill's response)."""
        if stages is not None and isinstance(params, dict):
            params[STAGES_KEY] = replace(stages, finished=time.time()).to_wire()


# Push: prefill worker -> decode workers, just before the WRITE: b"<prefix><time>:<decode's request id>"
# (WRITE_STARTED_NOTIF, from connector.side_notifs).


def write_started_notif(decode_request_id: str, at: float) -> bytes:
    return WRITE_STARTED_NOTIF + f"{at:.6f}:{decode_request_id}".encode()


def parse_write_started(notif: bytes) -> DecodeKvStamps | None:
    try:
        at, request_id = notif[len(WRITE_STARTED_NOTIF):].decode().split(":", 1)
        return DecodeKvStamps(request_id, write_started=float(at))
    except ValueError:  # not ours, or malformed (UnicodeDecodeError is a ValueError)
        return None


# Progressive push: a chunk WRITE's notification (connector.progressive), which decode's worker takes aside:
# b"<CHUNK_NOTIF><decode's request id>#<chunk index>:<prefill's world size>" (vLLM appends the size).


def chunk_notif_id(decode_request_id: str, index: int) -> str:
    return f"{CHUNK_NOTIF.decode()}{decode_request_id}#{index}"


def parse_chunk_landed(notif: bytes, at: float) -> DecodeKvStamps | None:
    try:
        request_id, index = notif[len(CHUNK_NOTIF):].decode().rsplit(":", 1)[0].rsplit("#", 1)
        return DecodeKvStamps(request_id, chunk_landed=at, chunk=int(index))
    except ValueError:  # malformed
        return None


class WriteClock(Feature):
    """On the push worker: prefill says when a WRITE starts, decode hands it to its replica and keeps
    the notification from vLLM's accounting."""

    UPSTREAM = frozenset({"_remote_agents", "nixl_wrapper", "_pending_completion_notifs"})

    def writing(self, req_id, meta) -> None:
        """Just before vLLM's WRITE (``_xfer_blocks_for_req``)."""
        remote = meta.remote
        notif = write_started_notif(remote.request_id, time.time())
        for agent_name in (self._remote_agents.get(remote.engine_id) or {}).values():
            try:
                self.nixl_wrapper.send_notif(agent_name, notif_msg=notif)
            except Exception:  # a stamp is never worth a transfer
                logger.debug("write-start stamp for %s not sent", req_id, exc_info=True)

    def take_notifs(self) -> None:
        """Before vLLM reads the step's notifications (decode): prefill's write-start stamps."""
        for notif in take(self._pending_completion_notifs, WRITE_STARTED_NOTIF):
            if (stamps := parse_write_started(notif)) is not None:
                send_stamps(stamps)


@dataclass(frozen=True)
class PrefillStages:
    """Prefill engine -> orchestrator: when it had a leg (in prefill's response, ``STAGES_KEY``)."""

    queued: float | None  # arrived at the engine (vLLM's Request.arrival_time)
    started: float | None  # first scheduled to compute
    finished: float | None
    prompt_tokens: int | None = None
    computed_tokens: int | None = None  # the prompt less what was read from elsewhere (history)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> PrefillStages:
        """Whatever of it is there and a number (another build may send less)."""
        raw = raw if isinstance(raw, dict) else {}
        return cls(*(_seconds(raw.get(name)) for name in ("queued", "started", "finished")),
                   *(_tokens(raw.get(name)) for name in ("prompt_tokens", "computed_tokens")))


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _tokens(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def listen_for_decode_stamps(on_stamps: Callable[[DecodeKvStamps], None]) -> socket.socket | None:
    """In the serving process, on its running event loop: call ``on_stamps`` for each
    datagram its engine sends. Returns the socket (close it to stop), or None if it could
    not be bound (the timeline then lacks the engine's KV stamps)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(stamps_address(os.getpid()))
    except OSError as exc:
        logger.warning("no KV stamps from the engine: %s", exc)
        sock.close()
        return None
    sock.setblocking(False)

    def drain() -> None:
        while True:
            try:
                data = sock.recv(4096)
            except OSError:  # nothing more to read (BlockingIOError), or the socket closed
                return
            stamps = DecodeKvStamps.from_wire(data)
            if stamps is not None:
                on_stamps(stamps)

    asyncio.get_running_loop().add_reader(sock.fileno(), drain)
    return sock
