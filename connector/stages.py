"""What the engines see of a request's stages (vLLM-side; no Ray, no ``app``).

The orchestrator times every stage of a request it can see (app/timeline.py); what
happens inside the engines it cannot. Their connector schedulers see it:

* prefill: the leg's arrival at the engine (``Request.arrival_time``, stamped by vLLM's
  frontend), its first allocation (scheduled to compute) and its finish. They travel back
  in the ``kv_transfer_params`` of prefill's response under ``STAGES_KEY``, as the reuse
  report does.
* decode: when the request's blocks were allocated for remote KV (push: registered with
  prefill; pull: its READ started) and when the KV had landed (the worker reported the
  receive complete). Decode's response carries no params when streamed, so these go to the
  engine's parent process (the serving replica) as one datagram per request, on an
  abstract UNIX socket named after that process (:func:`stamps_address`); a replica that
  does not listen loses nothing but the stamps.

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
from dataclasses import asdict, dataclass
from typing import Any

from connector.params import STAGES_KEY, is_decode_leg, is_prefill_leg

logger = logging.getLogger("vllm.rendezvous")


@dataclass(frozen=True)
class DecodeKvStamps:
    """Decode engine -> its replica: when one request's remote KV was asked for and landed."""

    request_id: str  # the engine's id (connector.params.external_request_id gives the replica's)
    requested: float  # push: blocks registered with prefill; pull: READ started
    landed: float  # the worker reported the receive complete

    def to_wire(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_wire(cls, data: bytes) -> DecodeKvStamps | None:
        try:
            raw = json.loads(data)
            return cls(str(raw["request_id"]), float(raw["requested"]), float(raw["landed"]))
        except (ValueError, KeyError, TypeError):
            return None


def stamps_address(replica_pid: int) -> bytes:
    """Abstract UNIX socket on which the serving process ``replica_pid`` hears its engine."""
    return b"\0rendezvous-stamps-%d" % replica_pid


class StageClock:
    """Mixin for the connector scheduler (push or pull, either role); put before vLLM's class."""

    def _state(self) -> dict[str, Any]:
        # Swapped in: no __init__ ran. started: prefill leg -> first allocation;
        # requested: decode request -> blocks allocated for remote KV.
        return self.__dict__.setdefault("_rendezvous_stage_state", {"started": {}, "requested": {}, "socket": None})

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        decode_leg = is_decode_leg(request.kv_transfer_params)  # before vLLM clears the flag
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if is_prefill_leg(request.kv_transfer_params):
            self._state()["started"].setdefault(request.request_id, time.time())
        elif decode_leg and num_external_tokens > 0:
            self._state()["requested"].setdefault(request.request_id, time.time())

    def update_connector_output(self, connector_output):
        super().update_connector_output(connector_output)
        requested = self._state()["requested"]
        for request_id in connector_output.finished_recving or ():
            at = requested.pop(request_id, None)
            if at is not None:
                self._send_stamps(DecodeKvStamps(request_id, at, time.time()))

    def request_finished(self, request, block_ids):
        state = self._state()
        started = state["started"].pop(request.request_id, None)
        state["requested"].pop(request.request_id, None)  # never landed (aborted, expired)
        prefill_leg = is_prefill_leg(request.kv_transfer_params)  # before vLLM rewrites the params
        delay, params = super().request_finished(request, block_ids)
        if prefill_leg and isinstance(params, dict):
            params[STAGES_KEY] = PrefillStages(getattr(request, "arrival_time", None), started, time.time()).to_wire()
        return delay, params

    def _send_stamps(self, stamps: DecodeKvStamps) -> None:
        state = self._state()
        if state["socket"] is None:
            state["socket"] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            state["socket"].setblocking(False)
        try:
            state["socket"].sendto(stamps.to_wire(), stamps_address(os.getppid()))
        except OSError:  # nobody listens (not under our replica): the stamps are only lost
            pass


@dataclass(frozen=True)
class PrefillStages:
    """Prefill engine -> orchestrator: when it had a leg (in prefill's response, ``STAGES_KEY``)."""

    queued: float | None  # arrived at the engine (vLLM's Request.arrival_time)
    started: float | None  # first scheduled to compute
    finished: float | None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> PrefillStages:
        """Whatever of it is there and a number (another build may send less)."""
        raw = raw if isinstance(raw, dict) else {}
        return cls(*(_seconds(raw.get(name)) for name in ("queued", "started", "finished")))


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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
