"""The decode Serve deployment (the prefill one is ``app.prefill.server``).

Ray Serve LLM's ``PDDecodeServer`` already does what push needs once a connector backend
asks for it: the ingress routes the request to a decode replica on arrival (through
``app.routing.decode_router``), the decode replica binds a prefill replica (``choose_replica``)
and sends both legs concurrently. ``DecodeServer`` gathers the facts of each request and
carries out what ``app.routing.planner`` decides; it adds:

* a fresh, unique request id per request — vLLM pairs the two legs by that id, so it
  must never come from a client header that may repeat;
* conditional disaggregation — a prompt whose part to compute (for a conversation turn:
  beyond the history this replica holds) is shorter than ``local_prefill_below_tokens``
  is prefilled by the decode engine itself: no prefill hop, no transfer; so is a request
  a prefill leg cannot serve (``app.routing.eligibility``: several sequences, prompt logprobs,
  what decode's engine would refuse) (``app.routing.planner``);
* late binding in pull mode — a disaggregated request without a conversation is only
  prefilled by the replica it reached first; the ingress then has it decoded where the
  load is lowest when prefill is done (``app.routing.late_binding``);
* a handoff that cannot hang — the prefill leg has a deadline sized to its work
  (``app.request.deadlines``); if it times out or fails before decode produced anything, decode
  prefills the prompt itself (``fallback``) instead of waiting for KV that will never come,
  or failing the request (``app.decode.handoff``); the queue deadline grows by the request's own
  work (a long prompt is not a queued one);
* conversations — a turn with a ``conversation_id`` gets its conversation's prefix-cache
  salt on decode, and, when this replica still retains the conversation, both legs ask
  the engines to reuse the history (``app.routing.conversations``, ``connector.push_reuse``);
  what happened to each turn's history is logged and counted (``app.decode.turns``);
* the load it carries (requests and tokens in flight, KV capacity) and the conversations
  it retains, published for the router through Serve's ``record_routing_stats`` hook,
  and counted in metrics.

It runs two short sampled generations on its engine before it takes traffic, as the prefill
server does (``app.replica.warmup``): a fresh engine's first sampled generation is seconds slower on CPU.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer

from app.config.args import HandoffArgs, PullHistory
from app.decode.handoff import Handoff, Served
from app.decode.metrics import DecodeMetrics
from app.decode.turns import TurnBook
from app.replica.prompts import load_tokenizer, prompt_token_ids
from app.replica.warmup import warm_up
from app.request.deadlines import Deadlines
from app.request.fields import DEFAULT_OUTPUT_BUDGET
from app.request.queue_deadline import (
    QueueDeadlineMoved,
    QueueExpired,
    before_queue_deadline,
    engine_has_started,
    moving_queue_deadline,
    queue_deadline_of,
)
from app.request.timeline import (
    DECODE_PICKED,
    FIRST_TOKEN,
    PREFILL_PICKED,
    RECEIVED,
    RequestTimeline,
    decode_picked_of,
    prefill_picked_at,
)
from app.routing.conversations import CONVERSATION_HEADER, ConversationTable, Turn, continues_a_conversation
from app.routing.eligibility import decode_alone_reason
from app.routing.late_binding import Prefilled
from app.routing.pipeline import PublishedLoad
from app.routing.planner import Plan, PlanSettings, RequestFacts, Route, plan
from app.routing.prefill_router import with_prompt_tokens
from connector.params import REUSE_KEY, TransferMode, external_request_id, kv_bytes_per_token, new_transfer_request_id
from connector.ray_backend import register_backends
from connector.stages import STAMPS_PID_ENV, DecodeKvStamps, listen_for_decode_stamps

logger = logging.getLogger("ray.serve." + __name__)  # under ray.serve: its handlers write the replica logs

# Replicas import this module when they unpickle their class; registering here makes the
# backends resolvable in every process, whoever built the app.
register_backends()

# Most recently used conversations a replica publishes to the routers (bounds the stats).
_PUBLISHED_CONVERSATIONS = 2000


class DecodeServer(PDDecodeServer):
    async def __init__(
        self,
        llm_config,
        *,
        prefill_server,
        mode: str,
        late_binding: bool,
        local_prefill_below_tokens: int,
        handoff: HandoffArgs,
        conversations,
        isolate_uncached: bool,
        **kwargs,
    ):
        """Every setting comes from the config (``app.builder``); their defaults live in ``app.config.args``."""
        os.environ[STAMPS_PID_ENV] = str(os.getpid())  # before the engine starts: its processes stamp to us
        await super().__init__(llm_config, prefill_server=prefill_server, **kwargs)
        settings = PlanSettings(
            mode=TransferMode(mode),
            local_prefill_below_tokens=local_prefill_below_tokens,
            late_binding=late_binding,
            upstream_history=bool(conversations) and TransferMode(mode) is TransferMode.PULL
            and conversations.pull_history is PullHistory.UPSTREAM,
            isolate_uncached=isolate_uncached,
        )
        self._setup(
            settings,
            replica_id=serve.get_replica_context().replica_id.unique_id,
            tokenizer=load_tokenizer(llm_config),
            deadlines=Deadlines.of(handoff),
            conversations=conversations,
            metrics=DecodeMetrics(mode),
        )
        self._stamps_socket = listen_for_decode_stamps(self._engine_stamped)
        await warm_up(self, llm_config.model_id, "decode")

    def _setup(self, settings: PlanSettings, *, replica_id: str, tokenizer, deadlines: Deadlines, conversations,
               metrics) -> None:
        """Everything but Ray's own state; tests call it on an object without an engine.
        ``conversations``: ``app.config.args.ConversationArgs``, or None when conversations are off."""
        self._settings, self._replica_id, self._tokenizer, self._metrics = settings, replica_id, tokenizer, metrics
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
            engine=lambda endpoint, request, raw: getattr(LLMServer, endpoint)(self, request, raw),
            deadlines=deadlines,
            timelines=self._timelines,
            replica_id=replica_id,
            push=lambda request, raw: self._pd_handle_request(request, raw),
            prefill=getattr(self, "_prefill_handle", None),
            backend=lambda: self._get_connector_backend(),
            **({"on_prefill_params": self._turns.prefill_reported, "on_kept": self._turns.kept} if self._turns else {}),
        )

    async def chat(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "chat")

    async def completions(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "completions")

    async def _concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info, *, cancel_on_failure=True):
        """Ray's push orchestration calls this; ours has a deadline (``app.decode.handoff``)."""
        async for chunk in self._handoff.concurrent_decode(method, decode_request, prefill_resp, raw_request_info):
            yield chunk

    def _engine_stamped(self, stamps: DecodeKvStamps) -> None:
        timeline = self._timelines.get(external_request_id(stamps.request_id))
        if timeline is not None:
            timeline.add_decode_kv_stamps(stamps)

    async def record_routing_stats(self) -> dict[str, Any]:
        # Serve calls this every routing.stats_period_s; re-setting the load gauges here keeps
        # them exported while idle (Ray exports a gauge only if it was set since the last export).
        self._metrics.load(self._ongoing, self._tokens_in_flight)
        stats = await super().record_routing_stats() or {}
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
        timeline = RequestTimeline(request_id, self._settings.mode.value, decided.route.value, stream)
        timeline.stamps.update(prefilled.stamps if prefilled else {})
        timeline.stamp(RECEIVED, received)
        if (picked := decode_picked_of(request)) is not None:
            timeline.stamp(DECODE_PICKED, picked)
        self._timelines[request_id] = timeline
        if prefilled is not None:
            logger.debug("request %s: prefilled via replica %s, decoded here", request_id, prefilled.entry_replica)
            gen = self._handoff.pull_decode(request, raw_request_info, endpoint, prefilled.kv_transfer_params)
        elif decided.route is Route.LOCAL:
            gen = await getattr(LLMServer, endpoint)(self, request, raw_request_info)
        else:
            gen = self._handoff.remote_or_fallback(
                with_prompt_tokens(request, prompt_tokens), raw_request_info, endpoint, served, history, decided.keep, decided.hand_off
            )
        if (waited := queue_deadline_of(request)) is not None:
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
        started, first = time.monotonic(), None
        try:
            async for chunk in gen:
                if first is None and not isinstance(chunk, (Prefilled, QueueExpired, QueueDeadlineMoved)):
                    first = time.monotonic() - started
                    timeline.stamp(FIRST_TOKEN, time.time())
                    if (picked := prefill_picked_at(request_id)) is not None:
                        timeline.stamp(PREFILL_PICKED, picked)
                    timeline.route = served.route.value
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
                self._metrics.finished(prefilled_by, stream, first, time.monotonic() - started)
                moved = prefilled is not None and prefilled.entry_replica != self._replica_id
                self._metrics.bound("late" if prefilled else "arrival", moved)
            if turn is not None:
                self._turns.end(turn, served.route, request_id, prompt_ids or [])

    def _begin_turn(self, request, raw_request_info, request_id: str) -> Turn | None:
        headers = getattr(raw_request_info, "headers", None) or {}
        conversation_id = headers.get(CONVERSATION_HEADER)
        if not conversation_id or self._turns is None:
            return None
        return self._turns.begin(conversation_id, request_id, continues_a_conversation(request))

    def _prompt_token_ids(self, request) -> list[int] | None:
        return prompt_token_ids(self._tokenizer, request)

    def _vllm_config(self):
        return getattr(self._engine_client(), "vllm_config", None)

    def _engine_client(self):
        return getattr(self.engine, "_engine_client", None)

    def _engine_started(self, request_id: str) -> bool:
        return engine_has_started(getattr(self._engine_client(), "output_processor", None), request_id)

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
