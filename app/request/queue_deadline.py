"""The queue deadline (``ingress.queue_deadline_s``): when an admitted request that has not started is given up on.

The setting is how long a request may *wait*; the time its own prompt takes to compute is added
by the decode replica, which knows it (``app.request.deadlines``: a 4k-token prompt on a slow box is not
a queued request). The ingress writes the deadline into the request (``app.request.envelope.QUEUE_DEADLINE_AT``).

A stream's deadline is then kept by the ingress: upstream returns a stream's response at its
first chunk, so the ingress waits for that, until the deadline the decode replica sends back
first (``QueueDeadlineMoved``), and again if its estimate of the request's work changes before
the first chunk (a decode replica that had no published prefill cost yet learns it at its
first prefill pick: ``app.request.deadlines``). A non-streamed answer comes whole, at the end, so "has it
started?" can only be told where its engine runs: when the deadline passes with no answer the
decode replica asks its engine whether the request's first token is out. If not, the request is
cancelled (the engine aborts it, the handoff its prefill leg) and ``QueueExpired`` goes back in
its place, which the ingress answers with the same 503 as a stream's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from connector.params import external_request_id

logger = logging.getLogger("ray.serve." + __name__)

RECHECK_S = 1.0  # how often a deadline that may move is read again while nothing came
MOVED_BY_S = 1.0  # a stream's deadline is sent again when it moved this much


@dataclass(frozen=True)
class QueueDeadline:
    """On the ingress's ``request.state``: when an admitted request that has not started is given up on."""

    at: float
    seconds: float
    retry_after_s: int


@dataclass(frozen=True)
class QueueExpired:
    """Decode replica -> ingress, instead of an answer: the request had not started by its deadline
    and was aborted."""

    request_id: str


@dataclass(frozen=True)
class QueueDeadlineMoved:
    """Decode replica -> ingress, a stream's first message, and another whenever it moves: its deadline
    (epoch seconds), grown by the request's own work."""

    at: float


class QueueDeadlinePassed(Exception):
    """Raised in the ingress when its decode replica answered ``QueueExpired``."""


async def before_queue_deadline(
    chunks: AsyncIterator[Any], at: Callable[[], float], started: Callable[[], bool], request_id: str
) -> AsyncIterator[Any]:
    """``chunks``; but if none has come by ``at()`` (read again every ``RECHECK_S``) and ``started()``
    says the engine has not produced a first token, they are cancelled and ``QueueExpired`` comes
    instead. A request that has started by then runs to its end, however long."""
    it = aiter(chunks)
    first = asyncio.ensure_future(anext(it))
    try:
        while not first.done() and (left := at() - time.time()) > 0:
            await asyncio.wait({first}, timeout=min(left, RECHECK_S))
        if not first.done() and not started():
            first.cancel()  # thrown into its await: AsyncLLM.generate aborts the engine request, the handoff its leg
            try:
                await first  # vLLM's serving layer may answer the cancel with an error response instead of raising
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
            if hasattr(chunks, "aclose"):
                with contextlib.suppress(Exception):
                    await chunks.aclose()
            logger.warning("request %s: not started by its queue deadline: aborted", request_id)
            yield QueueExpired(request_id)
            return
        await asyncio.wait({first})  # it started: its first chunk comes however long it takes
    finally:
        if not first.done():
            first.cancel()  # the caller went away while waiting
    async for chunk in _first_then_the_rest(first, it):
        yield chunk


async def moving_queue_deadline(chunks: AsyncIterator[Any], at: Callable[[], float]) -> AsyncIterator[Any]:
    """A stream's ``chunks``, after ``QueueDeadlineMoved(at())``, which comes again while no chunk has
    come whenever ``at()`` moved by ``MOVED_BY_S`` (the ingress keeps a stream's deadline)."""
    said = at()
    yield QueueDeadlineMoved(said)
    it = aiter(chunks)
    first = asyncio.ensure_future(anext(it))
    try:
        while not first.done():
            await asyncio.wait({first}, timeout=RECHECK_S)
            if not first.done() and abs(at() - said) >= MOVED_BY_S:
                said = at()
                yield QueueDeadlineMoved(said)
    finally:
        if not first.done():
            first.cancel()  # the caller went away while waiting
    async for chunk in _first_then_the_rest(first, it):
        yield chunk


async def _first_then_the_rest(first: asyncio.Future, it: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The chunk ``first`` (a done ``anext(it)``) got, unless the stream had ended, then the rest of ``it``."""
    try:
        chunk = first.result()
    except StopAsyncIteration:
        return
    yield chunk
    async for chunk in it:
        yield chunk


def engine_has_started(output_processor: Any, request_id: str) -> bool:
    """Whether vLLM's engine (``AsyncLLM.output_processor``, in this process) has produced a first
    token for our ``request_id`` (engine ids add an endpoint prefix and, for completions, an
    index). False if the engine does not hold it (not yet sent, or still with prefill); True if
    the engine cannot be read, so that a request is never aborted on a guess."""
    try:
        states, external = output_processor.request_states, output_processor.external_req_ids
        internal = [i for key, ids in list(external.items()) if external_request_id(key) == request_id for i in ids]
        return any(not states[i].is_prefilling for i in internal if i in states)
    except AttributeError as exc:  # an upgraded vLLM (connector/seams.py lists these names)
        logger.warning("cannot read the engine's request states (%r): the queue deadline is not enforced", exc)
        return True
