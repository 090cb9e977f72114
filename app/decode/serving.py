"""A decode replica's requests, carried out without Ray Serve or an engine: ``DecodeServing`` gathers each
request's facts, carries out what ``app.routing.planner`` decides, and keeps the load and the conversations the
replica publishes for the router (what each step does: ``app.decode.server``'s docstring). ``DecodeServer``
builds it once its engine is up and passes it the engine's side; tests pass stand-ins."""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse

from app.decode.handoff import Handoff, Served
from app.decode.turns import TurnBook
from app.replica.prompts import prompt_token_ids
from app.request.deadlines import Deadlines
from app.request.envelope import (
    DECODE_PICKED_AT,
    DEFAULT_OUTPUT_BUDGET,
    PREFILL_PICKS,
    PROMPT_TOKENS,
    QUEUE_DEADLINE_AT,
    Route,
    conversation_id_of,
)
from app.request.queue_deadline import QueueDeadlineMoved, QueueExpired, before_queue_deadline, moving_queue_deadline
from app.request.timeline import DECODE_PICKED, ENGINE_OUTPUT, FIRST_TOKEN, PREFILL_PICKED, RECEIVED, RequestTimeline
from app.routing.conversations import ConversationTable, Turn, continues_a_conversation
from app.routing.eligibility import decode_alone_reason
from app.routing.late_binding import Prefilled
from app.routing.pipeline import PublishedLoad
from app.routing.planner import Plan, PlanSettings, RequestFacts, plan
from connector.params import REUSE_KEY, external_request_id, kv_bytes_per_token, new_transfer_request_id
from connector.stages import DecodeKvStamps

logger = logging.getLogger("ray.serve.app.decode.server")  # the replica's log lines keep their logger's name

# Most recently used conversations a replica publishes to the routers (bounds the stats).
_PUBLISHED_CONVERSATIONS = 2000


class DecodeServing:
    """A decode replica's requests (``chat``, ``completions``) and what it publishes for the router (``routing_stats``)."""

    def __init__(self, settings: PlanSettings, *, replica_id: str, tokenizer, deadlines: Deadlines, conversations,
                 metrics, engine, push, prefill, backend, vllm_config, engine_started, first_tokens) -> None:
        """``conversations``: ``app.config.args.ConversationArgs``, or None when conversations are off. The engine's
        side (``DecodeServer``'s): ``engine(endpoint, request, raw)`` generates on decode's own engine (Ray's
        ``LLMServer.chat``/``completions``), ``push(request, raw)`` runs Ray's push orchestration, ``prefill`` is the
        prefill deployment's streaming handle (pull legs; None in push), ``backend()`` the connector backend,
        ``vllm_config()`` the engine's config (None without one), ``engine_started(request_id)`` whether the engine
        has a request's first token out, ``first_tokens`` when it had (``app.decode.first_token.FirstTokens``)."""
        self._settings, self._replica_id, self._tokenizer, self._metrics = settings, replica_id, tokenizer, metrics
        self._engine, self._vllm_config, self._engine_started = engine, vllm_config, engine_started
        self._first_tokens = first_tokens
        self._ongoing = 0
        self._tokens_in_flight = 0
        self._timelines: dict[str, RequestTimeline] = {}  # request id -> its timeline, while in flight here
        self._turns = None if not conversations else TurnBook(
            ConversationTable(conversations.retention_s), settings, metrics,
            recompute_threshold=conversations.recompute_threshold,
            block_size=lambda: self._vllm_config().cache_config.block_size,
            kv_bytes_per_token=lambda: kv_bytes_per_token(self._vllm_config()),
        )
        self._handoff = Handoff(
            mode=settings.mode,
            engine=engine,
            deadlines=deadlines,
            timelines=self._timelines,
            replica_id=replica_id,
            push=push,
            prefill=prefill,
            backend=backend,
            **({"on_prefill_params": self._turns.prefill_reported, "on_kept": self._turns.kept} if self._turns else {}),
        )

    async def chat(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "chat")

    async def completions(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "completions")

    def concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info):
        """Ray's push orchestration's decode leg (``DecodeServer._concurrent_decode``), with a deadline
        (``app.decode.handoff``)."""
        return self._handoff.concurrent_decode(method, decode_request, prefill_resp, raw_request_info)

    def engine_stamped(self, stamps: DecodeKvStamps) -> None:
        timeline = self._timelines.get(external_request_id(stamps.request_id))
        if timeline is not None:
            timeline.add_decode_kv_stamps(stamps)

    async def routing_stats(self, upstream) -> dict[str, Any]:
        """What the replica publishes for the router, added to ``upstream()``'s (Ray's ``record_routing_stats``)."""
        # Serve calls this every routing.stats_period_s; re-setting the load gauges here keeps
        # them exported while idle (Ray exports a gauge only if it was set since the last export).
        self._metrics.load(self._ongoing, self._tokens_in_flight)
        stats = await upstream() or {}
        now = time.time()
        conversations = ()
        if self._turns is not None:
            conversations = tuple(self._turns.table.known(_PUBLISHED_CONVERSATIONS))
            self._metrics.retained(len(self._turns.table.held(now)))
        return PublishedLoad(self._ongoing, self._tokens_in_flight, now, self._kv_capacity_tokens(), conversations).publish_into(stats)

    async def _serve(self, request, raw_request_info, endpoint: str):
        received = time.time()
        prefilled = Prefilled.attached_to(request)  # late binding: prefilled by another replica (only the ingress attaches it)
        request_id = prefilled.request_id if prefilled else new_transfer_request_id()
        turn = self._begin_turn(request, raw_request_info, request_id)
        prompt_ids = self._prompt_token_ids(request)
        stream = bool(getattr(request, "stream", False))
        decided = plan(RequestFacts(
            request_id=request_id,
            prompt_tokens=None if prompt_ids is None else len(prompt_ids),
            stream=stream,
            turn=turn,
            # A prefilled (late-bound) request was judged by the replica it reached first.
            alone_reason=None if prefilled else decode_alone_reason(
                request, None if prompt_ids is None else len(prompt_ids), self._max_model_len()),
            prefilled=prefilled is not None,
            client_salt=getattr(request, "cache_salt", None),
        ), self._settings)
        request = request.model_copy(update=_engine_fields(request_id, decided))
        served = Served(decided.route)
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else self._settings.local_prefill_below_tokens
        logger.debug("request %s: %d prompt tokens, %s prefill", request_id, prompt_tokens, decided.route.value)
        history = None
        if decided.read_back:
            history = self._turns.read_back(turn, request_id, prompt_ids or [])
        timeline = RequestTimeline(request_id, self._settings.mode, decided.route, stream)
        timeline.stamps.update(prefilled.stamps if prefilled else {})
        timeline.stamp(RECEIVED, received)
        if (picked := DECODE_PICKED_AT.read(request)) is not None:
            timeline.stamp(DECODE_PICKED, picked)
        self._timelines[request_id] = timeline
        if prefilled is not None:
            logger.debug("request %s: prefilled via replica %s, decoded here", request_id, prefilled.entry_replica)
            gen = self._handoff.pull_decode(request, raw_request_info, endpoint, prefilled.kv_transfer_params)
        elif decided.route is Route.LOCAL:
            gen = await self._engine(endpoint, request, raw_request_info)
        else:
            gen = self._handoff.remote_or_fallback(
                PROMPT_TOKENS.copy_with(request, prompt_tokens), raw_request_info, endpoint, served, history, decided.keep, decided.hand_off
            )
        if (waited := QUEUE_DEADLINE_AT.read(request)) is not None:
            def deadline() -> float:
                # The time a request may wait is the setting's; the time it takes to compute is its own, read
                # again while it waits (the cost it is sized by may be published meanwhile: app.request.deadlines). Once
                # prefill answered, the push KV deadline fixed in the leg, and decode's recompute, come first.
                deadlines = self._handoff.deadlines
                at = waited + deadlines.queue_extension_s(prompt_tokens)
                if (kv_given_up := self._handoff.kv_given_up_at(request_id)) is not None:
                    at = max(at, kv_given_up + deadlines.margin * deadlines.cost_s(prompt_tokens))
                return at

            if stream:  # the ingress holds a stream's deadline: it moves there
                gen = moving_queue_deadline(gen, deadline)
            else:
                gen = before_queue_deadline(
                    gen, deadline, lambda: self._engine_started(served.fallback_request_id or request_id), request_id)
        cost = prompt_tokens + (request.max_tokens or DEFAULT_OUTPUT_BUDGET)
        self._ongoing += 1
        self._tokens_in_flight += cost
        self._metrics.load(self._ongoing, self._tokens_in_flight)
        started, first = time.time(), None
        try:
            async for chunk in gen:
                if first is None and not isinstance(chunk, (Prefilled, QueueExpired, QueueDeadlineMoved)):
                    # A whole answer comes after its last token: the engine noted its first (app.decode.first_token).
                    first_at, engine_at = self._first_tokens.stamps(
                        served.fallback_request_id or request_id, stream, started, time.time())
                    if engine_at is not None:
                        timeline.stamp(ENGINE_OUTPUT, engine_at)
                    first = first_at - started
                    timeline.stamp(FIRST_TOKEN, first_at)
                    if (picked := PREFILL_PICKS.take_picked_at(request_id)) is not None:
                        timeline.stamp(PREFILL_PICKED, picked)
                    timeline.route = served.route
                    if not timeline.stream and not isinstance(chunk, ErrorResponse):
                        yield timeline  # the ingress reads it before the response it answers with
                yield chunk
            if timeline.stream and first is not None:
                yield timeline  # at the end: nothing waits for it
        finally:
            self._timelines.pop(request_id, None)
            self._ongoing -= 1
            self._tokens_in_flight -= cost
            self._metrics.load(self._ongoing, self._tokens_in_flight)
            if served.route is not Route.HANDED_OFF:  # the replica that decodes it counts it
                # A remote prefill whose KV did not land, or landed wrong, was recomputed here (kv_load_failure_policy).
                failure = timeline.kv_failure if served.route is Route.REMOTE else None
                prefilled_by = failure or served.route.value
                if failure:
                    logger.warning("request %s: its KV from prefill was not used (%s); decode recomputed the prompt",
                                   request_id, failure)
                self._metrics.finished(prefilled_by, stream, first, time.time() - started)
                moved = prefilled is not None and prefilled.entry_replica != self._replica_id
                self._metrics.bound("late" if prefilled else "arrival", moved)
            if turn is not None:
                self._turns.end(turn, served.route, request_id, prompt_ids or [])

    def _begin_turn(self, request, raw_request_info, request_id: str) -> Turn | None:
        conversation_id = conversation_id_of(raw_request_info)
        if not conversation_id or self._turns is None:
            return None
        return self._turns.begin(conversation_id, request_id, continues_a_conversation(request))

    def _prompt_token_ids(self, request) -> list[int] | None:
        return prompt_token_ids(self._tokenizer, request)

    def _max_model_len(self) -> int | None:
        return getattr(getattr(self._vllm_config(), "model_config", None), "max_model_len", None)

    def _kv_capacity_tokens(self) -> int | None:
        cache = getattr(self._vllm_config(), "cache_config", None)
        if cache is None or not cache.num_gpu_blocks:
            return None
        return cache.num_gpu_blocks * cache.block_size


def _engine_fields(request_id: str, decided: Plan) -> dict[str, Any]:
    """What the request carries to the engines. Client-sent kv_transfer_params never reach
    an engine: they name peers to connect to."""
    fields: dict[str, Any] = {"request_id": request_id, "kv_transfer_params": None}
    if decided.push_reuse:
        fields["kv_transfer_params"] = {REUSE_KEY: True}  # both legs (connector.ray_backend)
    if decided.cache_salt is not None:
        fields["cache_salt"] = decided.cache_salt
    return fields
