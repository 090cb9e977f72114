"""The decode replica's handoff: the prefill leg, its deadline, the fallback and the drain.

A :class:`Handoff` is built by ``DecodeServer`` from what it needs (decode's own engine,
the prefill deployment, the connector backend, Ray's push orchestration) so that tests
build a real one from stand-ins. It never hangs and never fails a request decode can
serve itself: the prefill leg has a deadline sized to its work (``app.request.deadlines``: its prompt and
the work queued ahead of it on its prefill replica, at the prefill cost this replica measured), and
the pick of a prefill replica before it has the deadline's floor (push: Ray's orchestration waits in
that pick for as long as no prefill replica is routable, e.g. while a lost prefill node's replica is
being replaced); if either fails or times out before decode produced anything, decode prefills the
prompt itself (:attr:`Route.FALLBACK`) and the prefill leg is aborted (it would only cost compute).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse

from app.request.deadlines import Deadlines
from app.request.envelope import PREFILL_PICKS, PROMPT_TOKENS, Route
from app.request.timeline import LEGS_SENT, PREFILL_ANSWERED, RequestTimeline
from app.routing.late_binding import Prefilled
from connector.params import (
    KEEP_HISTORY_KEY,
    KV_DEADLINE_KEY,
    REUSE_REPORT_KEY,
    STAGES_KEY,
    TransferMode,
    new_transfer_request_id,
)

logger = logging.getLogger("ray.serve." + __name__)

# Decode's own engine: (endpoint, request, raw request info) -> its response chunks.
Engine = Callable[[str, Any, Any], Awaitable[AsyncIterator]]


class HandoffFailed(Exception):
    """The prefill leg failed or missed its deadline before decode produced anything."""


@dataclass
class Served:
    """How one request is being prefilled; a remote plan may end up FALLBACK or HANDED_OFF."""

    route: Route
    fallback_request_id: str | None = None  # the decode engine's request id after a fallback (a fresh one)


class Handoff:
    def __init__(
        self,
        *,
        mode: TransferMode,
        engine: Engine,
        deadlines: Deadlines,
        timelines: dict[str, RequestTimeline],
        replica_id: str = "",
        push: Callable[[Any, Any], AsyncIterator] | None = None,
        prefill: Any = None,
        backend: Callable[[], Any] | None = None,
        on_prefill_params: Callable[[str, dict], None] = lambda request_id, params: None,
        on_kept: Callable[[str, dict], None] = lambda request_id, params: None,
    ):
        """``push``: Ray's PD orchestration (``_pd_handle_request``), which calls back into
        :meth:`concurrent_decode`. ``prefill``: the prefill deployment handle and
        ``backend``: the connector backend, both for pull. ``on_prefill_params``: prefill's
        response params (push; pull: those that report on the history); ``on_kept``: decode's response
        params of a turn it keeps (pull)."""
        self.mode, self._engine, self.deadlines, self._timelines = mode, engine, deadlines, timelines
        self._replica_id, self._push, self._prefill, self._backend = replica_id, push, prefill, backend
        self._on_prefill_params, self._on_kept = on_prefill_params, on_kept
        self._legs_out: dict[str, asyncio.Event] = {}  # push: request id -> set once its legs went out
        self._work: dict[str, int] = {}  # request id -> its prompt tokens, while its handoff runs
        # Push: request id -> when decode's engine gives up its KV (fixed in the leg when it went out), known once
        # prefill answered (only then is the KV due: a leg still queued behind others is waiting); None before.
        self._kv_given_up_at: dict[str, float | None] = {}

    async def remote_or_fallback(self, request, raw_request_info, endpoint: str, served: Served, history=None,
                                 keep=False, hand_off=False):
        """Disaggregated prefill; if the handoff fails before anything reached the client,
        the decode engine prefills the prompt itself (a fresh engine request id: the
        aborted one may still be finishing)."""
        self._work[request.request_id] = PROMPT_TOKENS.read(request) or 0
        try:
            async for chunk in self._remote_or_fallback(request, raw_request_info, endpoint, served, history, keep, hand_off):
                yield chunk
        finally:
            self._work.pop(request.request_id, None)
            self._kv_given_up_at.pop(request.request_id, None)

    def kv_given_up_at(self, request_id: str) -> float | None:
        """Push, once prefill answered: when decode's engine gives up waiting for the KV (wall clock), fixed in
        the leg when it went out. The request is no longer queued: its queue deadline must leave room after this
        for decode's recompute (a share of the KV that never lands is the ladder's, not the queue's)."""
        return self._kv_given_up_at.get(request_id)

    async def _remote_or_fallback(self, request, raw_request_info, endpoint: str, served: Served, history, keep,
                                  hand_off):
        if self.mode is TransferMode.PULL:
            remote = self.pull_handoff(request, raw_request_info, endpoint, history, keep, hand_off)
            first_chunk = remote.__anext__()
        else:
            remote = self._push(request, raw_request_info)
            first_chunk = self._first_push_chunk(remote, request.request_id)
        try:
            first = await first_chunk
            failure = _server_error(first)
        except StopAsyncIteration:
            return
        except Exception as exc:  # the handoff's own failures and a dead prefill replica alike
            failure = str(exc) or type(exc).__name__
        if failure is None:
            if isinstance(first, Prefilled):
                served.route = Route.HANDED_OFF
            yield first
            async for chunk in remote:
                yield chunk
            return
        await remote.aclose()
        served.route = Route.FALLBACK
        logger.warning("request %s: handoff failed (%s); decode prefills it locally", request.request_id, failure)
        local = request.model_copy(update={"request_id": new_transfer_request_id()})
        served.fallback_request_id = local.request_id
        async for chunk in await self._engine(endpoint, local, raw_request_info):
            yield chunk

    def prefill_deadline_s(self, request_id: str) -> float:
        """The prefill leg's deadline from dispatch: its work and, once its prefill replica is
        picked, the work queued ahead of it there (``app.request.deadlines``)."""
        tokens = self._work.get(request_id, 0)
        return self.deadlines.prefill_s(tokens, PREFILL_PICKS.tokens_ahead(request_id) or 0)

    async def _first_push_chunk(self, remote: AsyncIterator, request_id: str):
        """Push: the first chunk, but no later than the deadline's floor after the start if Ray's
        orchestration has not picked a prefill replica by then (its legs not sent: no
        :meth:`concurrent_decode` yet); from there that method's own deadline holds."""
        legs_out = self._legs_out[request_id] = asyncio.Event()
        first = asyncio.ensure_future(remote.__anext__())
        sent = asyncio.ensure_future(legs_out.wait())
        pick_s = self.deadlines.prefill_floor_s
        try:
            await asyncio.wait({first, sent}, timeout=pick_s, return_when=asyncio.FIRST_COMPLETED)
            if not first.done() and not legs_out.is_set():
                first.cancel()
                with contextlib.suppress(BaseException):
                    await first
                raise HandoffFailed(f"no prefill replica could be picked within {pick_s:g} s")
            return await first
        finally:
            sent.cancel()
            if not first.done():  # our own consumer went away (hang-up, queue deadline)
                first.cancel()
            self._legs_out.pop(request_id, None)

    async def pull_handoff(self, request, raw_request_info, endpoint: str, history=None, keep=False, hand_off=False):
        """Pull: prefill first (bounded by the deadline), then decode READs its KV: here,
        or with ``hand_off`` (late binding) on the replica the ingress picks next, to which
        this one answers with a :class:`Prefilled`. With ``history``, prefill first READs
        that much of a conversation's history back from decode; with ``keep``, decode
        keeps this turn's blocks for the next turn."""
        prefill_request = self._backend().prepare_prefill_request(request=request, peer=None)
        if history is not None:
            prefill_request.kv_transfer_params = history
        timeline = self._timelines.get(request.request_id)
        if timeline is not None:
            timeline.stamp(LEGS_SENT, time.time())
        prefill = getattr(self._prefill, endpoint).remote(prefill_request, raw_request_info)
        answer_task = asyncio.ensure_future(prefill.__anext__())
        try:
            # The deadline is read again when it passes: the prefill router's pick, made meanwhile,
            # adds the work it found queued ahead.
            dispatched = time.monotonic()
            while not answer_task.done():
                deadline_s = self.prefill_deadline_s(request.request_id)
                if (left := dispatched + deadline_s - time.monotonic()) <= 0:
                    raise HandoffFailed(f"prefill did not answer within {deadline_s:.0f} s, the deadline for its work")
                await asyncio.wait({answer_task}, timeout=left)
            answer = answer_task.result()
        except BaseException:
            # The deadline passed, the client hung up or the queue deadline passed: prefill stops
            # too (it holds no decode resources in pull: dropping it is clean).
            answer_task.cancel()
            prefill.cancel()
            raise
        if isinstance(answer, ErrorResponse):
            yield answer
            return
        async for _ in prefill:  # one token: let the response complete
            pass
        params = dict(answer.kv_transfer_params or {})
        report = params.pop(STAGES_KEY, None)
        if timeline is not None:
            timeline.stamp(PREFILL_ANSWERED, time.time())
            timeline.add_prefill_report(report)
        answer.kv_transfer_params = params
        if REUSE_REPORT_KEY in params:  # the history it READ back landed wrong (connector.pull_checksum)
            self._on_prefill_params(request.request_id, params)
        if hand_off:
            stamps = dict(timeline.stamps) if timeline else {}  # the decoding replica goes on with them
            yield Prefilled(request.request_id, answer.kv_transfer_params, self._replica_id, stamps)
            return
        async for chunk in self.pull_decode(request, raw_request_info, endpoint, answer.kv_transfer_params, keep):
            yield chunk

    async def pull_decode(self, request, raw_request_info, endpoint: str, prefill_params: dict, keep=False):
        """Pull: the decode leg, READing the KV that prefill's answer (``prefill_params``) points to."""
        prefill_response = types.SimpleNamespace(kv_transfer_params=prefill_params)
        decode_request = self._backend().prepare_decode_request(
            request=request, peer=None, prefill_response=prefill_response
        )
        if keep:
            decode_request.kv_transfer_params = {**decode_request.kv_transfer_params, KEEP_HISTORY_KEY: True}
        async for chunk in await self._engine(endpoint, decode_request, raw_request_info):
            params = getattr(chunk, "kv_transfer_params", None)
            if params:
                chunk.kv_transfer_params = None  # engine addresses and block ids are not the client's business
                if keep:
                    self._on_kept(request.request_id, params)
            yield chunk

    async def concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info):
        """Push: decode waits for KV that only the prefill leg can produce. Ray's version
        (``PDOrchestratorMixin._concurrent_decode``) waits for it without a deadline; this
        one gives the prefill leg its deadline (``app.request.deadlines``) and raises
        :class:`HandoffFailed` if it fails or times out before decode's first chunk; decode's
        engine gets the matching KV deadline with the leg. Once decode produced a chunk its
        KV has arrived, and a later prefill failure is moot."""
        request_id = decode_request.request_id
        timeline = self._timelines.get(request_id)
        if timeline is not None:
            timeline.stamp(LEGS_SENT, time.time())
        if (legs_out := self._legs_out.get(request_id)) is not None:
            legs_out.set()
        tokens = self._work.get(request_id, 0)
        deadline_s = self.prefill_deadline_s(request_id)  # its prefill replica is picked by now
        kv_s = self.deadlines.kv_s(tokens, PREFILL_PICKS.tokens_ahead(request_id) or 0)
        if kv_s > self.deadlines.kv_floor_s:  # else the engine's own default (handoff.kv_timeout_s) is the same
            decode_request.kv_transfer_params = {**(decode_request.kv_transfer_params or {}), KV_DEADLINE_KEY: kv_s}
        given_up_at = time.time() + max(kv_s, self.deadlines.kv_floor_s)
        self._kv_given_up_at[request_id] = None
        prefill = asyncio.create_task(_drain_prefill(prefill_resp))
        prefill.add_done_callback(lambda task: self._prefill_done(request_id, task, given_up_at))
        decode = await self._engine(method, decode_request, raw_request_info)
        chunks = decode.__aiter__()
        next_chunk = asyncio.ensure_future(chunks.__anext__())
        deadline = time.monotonic() + deadline_s
        try:
            while not next_chunk.done():
                if prefill.done():
                    failure = _prefill_failure(prefill)
                    if failure is not None:
                        raise HandoffFailed(failure)
                    await asyncio.wait({next_chunk})
                    break
                done, _ = await asyncio.wait(
                    {next_chunk, prefill}, timeout=max(0.0, deadline - time.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    raise HandoffFailed(f"prefill did not finish within {deadline_s:.0f} s, the deadline for "
                                        f"{tokens} prompt tokens")
            try:
                yield next_chunk.result()
            except StopAsyncIteration:
                return
            async for chunk in chunks:
                yield chunk
            # Let the prefill response complete here: Serve's router counts it done then.
            await asyncio.wait({prefill}, timeout=deadline_s)
        finally:
            if not next_chunk.done():
                next_chunk.cancel()
                with contextlib.suppress(BaseException):
                    await next_chunk
            with contextlib.suppress(BaseException):
                await decode.aclose()  # aborts the engine request if it is still running
            if not prefill.done():
                # Nobody waits for its answer (the client hung up, the queue deadline passed, or
                # decode computes the prompt itself): prefill stops computing it. The blocks decode
                # registered are freed at the registration's expiry, which prefill never WRITEs that
                # close to (connector/push_deadline.py).
                prefill_resp.cancel()
                prefill.cancel()

    def _prefill_done(self, request_id: str, prefill: asyncio.Task, kv_given_up_at: float) -> None:
        """Push: keep what prefill's response reports (reuse; the engine's stage stamps), and from now on when
        decode's engine gives up the KV."""
        if prefill.cancelled() or prefill.exception() is not None:
            return
        params = prefill.result()[1] or {}
        if request_id in self._kv_given_up_at:  # not if the handoff ended meanwhile
            self._kv_given_up_at[request_id] = kv_given_up_at
        timeline = self._timelines.get(request_id)
        if timeline is not None:
            timeline.stamp(PREFILL_ANSWERED, time.time())
            timeline.add_prefill_report(params.get(STAGES_KEY))
        self._on_prefill_params(request_id, params)


def _server_error(chunk: Any) -> str | None:
    """The message of a server-side error chunk; client errors (4xx) pass through."""
    if isinstance(chunk, ErrorResponse) and chunk.error.code >= 500:
        return chunk.error.message
    return None


async def _drain_prefill(prefill_resp) -> tuple[ErrorResponse | None, dict | None]:
    """Consume a push-mode prefill response: (its error, if any; its kv_transfer_params).
    Ray's ``_drain_prefill`` does the same but drops the response's kv_transfer_params."""
    last = None
    try:
        async for chunk in prefill_resp:
            if isinstance(chunk, ErrorResponse):
                return chunk, None
            last = chunk
    except TypeError:  # a non-streaming response
        last = await prefill_resp
        if isinstance(last, ErrorResponse):
            return last, None
    return None, getattr(last, "kv_transfer_params", None) or {}


def _prefill_failure(prefill: asyncio.Task) -> str | None:
    try:
        result, _ = prefill.result()
    except BaseException as exc:
        return f"prefill failed: {exc or type(exc).__name__}"
    if isinstance(result, ErrorResponse):
        return f"prefill returned {result.error.code}: {result.error.message}"
    return None
