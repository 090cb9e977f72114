"""The prefill and decode Serve deployments.

Ray Serve LLM's ``PDDecodeServer`` already does what push needs once a connector backend
asks for it: the ingress routes the request to a decode replica on arrival (through
``app.decode_router``), the decode replica binds a prefill replica (``choose_replica``)
and sends both legs concurrently. ``DecodeServer`` adds:

* a fresh, unique request id per request — vLLM pairs the two legs by that id, so it
  must never come from a client header that may repeat;
* conditional disaggregation — a prompt whose part to compute (for a conversation turn:
  beyond the history this replica holds) is shorter than ``local_prefill_below_tokens``
  is prefilled by the decode engine itself: no prefill hop, no transfer; so is a request
  a prefill leg cannot serve (``app.eligibility``: several sequences, prompt logprobs,
  what decode's engine would refuse);
* late binding in pull mode — a disaggregated request without a conversation is only
  prefilled by the replica it reached first; the ingress then has it decoded where the
  load is lowest when prefill is done (``app.late_binding``);
* a handoff that cannot hang — the prefill leg has ``prefill_timeout_s``; if it times out
  or fails before decode produced anything, decode prefills the prompt itself
  (``fallback``) instead of waiting for KV that will never come, or failing the request;
* conversations — a turn with a ``conversation_id`` gets its conversation's prefix-cache
  salt on decode, and, when this replica still retains the conversation, both legs ask
  the engines to reuse the history (``app.conversations``, ``connector.push_reuse``);
  what happened to each turn's history is logged and counted;
* the load it carries (requests and tokens in flight, KV capacity) and the conversations
  it retains, published for the router through Serve's ``record_routing_stats`` hook,
  and counted in metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import types
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer, PDPrefillServer
from ray.serve.metrics import Counter, Gauge, Histogram

from app.args import PullHistory
from app.conversations import CONVERSATION_HEADER, ConversationTable, Turn, continues_a_conversation
from app.decode_router import STATS_KEY
from app.eligibility import decode_alone_reason
from app.late_binding import Prefilled
from app.prefill_router import expect_prefill
from app.timeline import FIRST_TOKEN, LEGS_SENT, PREFILL_ANSWERED, RECEIVED, RequestTimeline
from connector.params import (
    KEEP_HISTORY_KEY,
    REUSE_KEY,
    REUSE_REPORT_KEY,
    STAGES_KEY,
    external_request_id,
    new_transfer_request_id,
    pull_history_params,
    verified_history_tokens,
)
from connector.ray_backend import register_backends
from connector.stages import DecodeKvStamps, listen_for_decode_stamps

logger = logging.getLogger("ray.serve.rendezvous.servers")  # under ray.serve: its handlers write the replica logs

# Replicas import this module when they unpickle their class; registering here makes the
# backends resolvable in every process, whoever built the app.
register_backends()

# Output budget assumed for load accounting when a request sets no max_tokens.
_DEFAULT_OUTPUT_BUDGET = 256
# Most recently used conversations a replica publishes to the routers (bounds the stats).
_PUBLISHED_CONVERSATIONS = 2000


class PrefillServer(PDPrefillServer):
    """Ray's prefill server, publishing its outstanding prefill work for the prefill
    router (``app.prefill_router``): the prompt tokens of the legs in flight here."""

    async def __init__(self, llm_config, **kwargs):
        await super().__init__(llm_config, **kwargs)
        self._tokenizer = _load_tokenizer(llm_config)
        self._ongoing = 0
        self._tokens_in_flight = 0

    async def chat(self, request, raw_request_info=None):
        return self._counted(request, await super().chat(request, raw_request_info))

    async def completions(self, request, raw_request_info=None):
        return self._counted(request, await super().completions(request, raw_request_info))

    async def _counted(self, request, chunks):
        tokens = len(prompt_token_ids(self._tokenizer, request) or ())
        self._ongoing += 1
        self._tokens_in_flight += tokens
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self._ongoing -= 1
            self._tokens_in_flight -= tokens

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = await super().record_routing_stats() or {}
        stats[STATS_KEY] = {"ongoing": self._ongoing, "tokens_in_flight": self._tokens_in_flight, "recorded_at": time.time()}
        return stats


class HandoffFailed(Exception):
    """The prefill leg failed or missed its deadline before decode produced anything."""


@dataclass
class _Route:
    """How one request was served: ``local``, ``remote`` or ``fallback`` prefill, or
    ``handed_off``: prefilled here and decoded on the replica the ingress picked next."""

    prefill: str


HANDED_OFF = "handed_off"


@dataclass
class _KeptHistory:
    """Pull with upstream read-back: what decode kept of a conversation's last turn."""

    params: dict  # kv_transfer_params of decode's response: where the blocks are
    token_ids: list[int]  # the turn's prompt as rendered here: what the kept KV is verified against
    kept_at: float


class DecodeServer(PDDecodeServer):
    async def __init__(
        self,
        llm_config,
        *,
        prefill_server,
        mode: str = "push",
        late_binding: bool = False,
        local_prefill_below_tokens: int = 0,
        prefill_timeout_s: float = 30.0,
        conversations=None,
        isolate_uncached: bool = False,
        **kwargs,
    ):
        await super().__init__(llm_config, prefill_server=prefill_server, **kwargs)
        self._mode = mode
        self._late_binding = late_binding
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._local_below = local_prefill_below_tokens
        self._prefill_timeout_s = prefill_timeout_s
        self._tokenizer = _load_tokenizer(llm_config)
        self._ongoing = 0
        self._tokens_in_flight = 0
        self._metrics = DecodeMetrics(mode)
        self._late_prefills: set[asyncio.Task] = set()  # kept referenced until they end
        # ConversationArgs, or None when conversations are off.
        self._conversations = ConversationTable(conversations.retention_s) if conversations else None
        self._isolate_uncached = isolate_uncached
        self._reuse_reports: dict[str, dict] = {}  # request id -> prefill's report, until the turn ends
        self._upstream_history = bool(conversations) and mode == "pull" and conversations.pull_history is PullHistory.UPSTREAM
        self._recompute_threshold = conversations.recompute_threshold if conversations else 0
        self._kept: dict[str, _KeptHistory] = {}  # conversation id -> its last turn's blocks (upstream read-back)
        self._kept_params: dict[str, dict] = {}  # request id -> decode's response params, until the turn ends
        self._timelines: dict[str, RequestTimeline] = {}  # request id -> its timeline, while in flight here
        self._stamps_socket = listen_for_decode_stamps(self._engine_stamped)

    async def chat(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "chat")

    async def completions(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "completions")

    def _engine_stamped(self, stamps: DecodeKvStamps) -> None:
        timeline = self._timelines.get(external_request_id(stamps.request_id))
        if timeline is not None:
            timeline.add_decode_kv_stamps(stamps.requested, stamps.landed)

    async def record_routing_stats(self) -> dict[str, Any]:
        # Serve calls this every routing.stats_period_s; re-setting the load gauges here keeps
        # them exported while idle (Ray exports a gauge only if it was set since the last export).
        self._metrics.load(self._ongoing, self._tokens_in_flight)
        stats = await super().record_routing_stats() or {}
        now = time.time()
        stats[STATS_KEY] = {
            "ongoing": self._ongoing,
            "tokens_in_flight": self._tokens_in_flight,
            "kv_capacity_tokens": self._kv_capacity_tokens(),
            "recorded_at": now,
        }
        if self._conversations is not None:
            stats[STATS_KEY]["conversations"] = self._conversations.known(_PUBLISHED_CONVERSATIONS)
            self._metrics.retained(len(self._conversations.held(now)))
        return stats

    async def _serve(self, request, raw_request_info, endpoint: str):
        received = time.time()
        prefilled = Prefilled.attached_to(request)  # late binding: prefilled by another replica (only the ingress attaches it)
        # Client-sent kv_transfer_params never reach an engine: they name peers to connect to.
        update: dict[str, Any] = {
            "request_id": prefilled.request_id if prefilled else new_transfer_request_id(), "kv_transfer_params": None,
        }
        turn = self._begin_turn(request, raw_request_info)
        if turn is not None:
            update["cache_salt"] = _salt(request, turn.cache_salt)
            if turn.reuse and self._mode == "push":
                update["kv_transfer_params"] = {REUSE_KEY: True}  # both legs (connector.ray_backend)
        elif self._isolate_uncached:
            update["cache_salt"] = _salt(request, update["request_id"])
        request = request.model_copy(update=update)
        prompt_ids = self._prompt_token_ids(request)
        # Unknown counts as long enough to disaggregate.
        prompt_tokens = len(prompt_ids) if prompt_ids is not None else self._local_below
        history = None
        if turn is not None:
            self._reuse_reports[request.request_id] = None  # filled in by the prefill leg, if it reports
            if self._upstream_history:
                history = self._read_back(turn, request.request_id, prompt_ids or [])
        # What would have to be computed: for a conversation turn, beyond the history held here.
        to_compute = prompt_tokens - (turn.held_tokens if turn is not None and turn.reuse else 0)
        alone = None  # a prefilled (late-bound) request was judged by the replica it reached first
        if prefilled is None:
            alone = decode_alone_reason(request, None if prompt_ids is None else len(prompt_ids), self._max_model_len())
        route = _Route("local" if prefilled is None and (alone or to_compute < self._local_below) else "remote")
        logger.debug(
            "request %s: %d prompt tokens, %s prefill%s", request.request_id, prompt_tokens, route.prefill,
            f" ({alone})" if alone else "",
        )
        timeline = RequestTimeline(request.request_id, self._mode, route.prefill, bool(getattr(request, "stream", False)))
        timeline.stamps.update(prefilled.stamps if prefilled else {})
        timeline.stamp(RECEIVED, received)
        self._timelines[request.request_id] = timeline
        if prefilled is not None:
            logger.debug("request %s: prefilled via replica %s, decoded here", request.request_id, prefilled.entry_replica)
            gen = self._pull_decode(request, raw_request_info, endpoint, prefilled.kv_transfer_params)
        elif route.prefill == "local":
            gen = await getattr(LLMServer, endpoint)(self, request, raw_request_info)
        else:
            expect_prefill(request.request_id, prompt_tokens)  # for the prefill router, in this process
            keep = turn is not None and self._upstream_history and not getattr(request, "stream", False)
            hand_off = self._late_binding and turn is None
            gen = self._remote_or_fallback(request, raw_request_info, endpoint, route, history, keep, hand_off)
        cost = prompt_tokens + (request.max_tokens or _DEFAULT_OUTPUT_BUDGET)
        self._ongoing += 1
        self._tokens_in_flight += cost
        self._metrics.load(self._ongoing, self._tokens_in_flight)
        started, first = time.monotonic(), None
        try:
            async for chunk in gen:
                if first is None and not isinstance(chunk, Prefilled):
                    first = time.monotonic() - started
                    timeline.stamp(FIRST_TOKEN, time.time())
                    timeline.route = route.prefill
                    if not timeline.stream and not isinstance(chunk, ErrorResponse):
                        yield timeline  # the ingress reads it before the response it answers with
                yield chunk
            if timeline.stream and first is not None:
                yield timeline  # at the end: nothing waits for it
        finally:
            self._timelines.pop(request.request_id, None)
            self._ongoing -= 1
            self._tokens_in_flight -= cost
            self._metrics.load(self._ongoing, self._tokens_in_flight)
            if route.prefill != HANDED_OFF:  # the replica that decodes it counts it
                self._metrics.finished(route.prefill, getattr(request, "stream", False), first, time.monotonic() - started)
                moved = prefilled is not None and prefilled.entry_replica != self._replica_id
                self._metrics.bound("late" if prefilled else "arrival", moved)
            if turn is not None:
                self._end_turn(turn, route, request.request_id, prompt_ids or [])

    def _begin_turn(self, request, raw_request_info) -> Turn | None:
        headers = getattr(raw_request_info, "headers", None) or {}
        conversation_id = headers.get(CONVERSATION_HEADER)
        if not conversation_id or self._conversations is None:
            return None
        return self._conversations.begin(conversation_id, time.time(), continues_a_conversation(request))

    def _end_turn(self, turn: Turn, route: _Route, request_id: str, prompt_ids: list[int]) -> None:
        now = time.time()
        prompt_tokens = len(prompt_ids)
        self._conversations.end(turn, now, prompt_tokens)
        report = self._reuse_reports.pop(request_id, None)
        kept = self._kept_params.pop(request_id, None)
        if kept is not None:
            self._kept[turn.conversation_id] = _KeptHistory(kept, prompt_ids, now)
        if not turn.reuse:
            outcome = turn.reason
        elif route.prefill != "remote":
            outcome = route.prefill  # local: decode prefilled it from its own cache; fallback
        elif self._mode != "push" and not self._upstream_history:
            outcome = "unsupported"  # pull: prefill recomputes; decode still reads only the new tail
        else:
            outcome = report["reason"] if report else "unreported"
        report = report or {}
        reused, pushed = report.get("reused_tokens", 0), report.get("pushed_tokens", 0)
        per_token = report.get("kv_bytes_per_token", 0)
        self._metrics.turn(outcome, reused, prompt_tokens - reused, reused * per_token, pushed * per_token)
        logger.info(
            "conversation %s, request %s: history %s; %d prompt tokens, %d reused (%d B read back), %d pushed (%d B)",
            turn.conversation_id, request_id, outcome, prompt_tokens, reused, reused * per_token, pushed, pushed * per_token,
        )

    def _read_back(self, turn: Turn, request_id: str, prompt_ids: list[int]) -> dict | None:
        """Pull with upstream read-back: the prefill leg's params that READ the verified
        prefix of the history this replica kept, or None (and why, as the turn's report)."""
        kept = self._kept.pop(turn.conversation_id, None)
        now = time.time()
        for cid in [c for c, k in self._kept.items() if now - k.kept_at > self._conversations.retention_s]:
            del self._kept[cid]  # conversations that never came back; decode freed their blocks
        if not turn.reuse:
            return None
        block_size, tokens, reason = self._cache_config().block_size, 0, "no_offer"  # e.g. the last turn was streamed
        if kept is not None:
            tokens = verified_history_tokens(kept.token_ids, prompt_ids, block_size)
            reason = "no_match" if tokens == 0 else "threshold" if tokens < max(1, self._recompute_threshold) else "reused"
        self._reuse_reports[request_id] = {
            "reason": reason, "reused_tokens": tokens if reason == "reused" else 0, "pushed_tokens": 0,
            "kv_bytes_per_token": self._kv_bytes_per_token(),
        }
        return pull_history_params(kept.params, tokens, block_size) if reason == "reused" else None

    async def _remote_or_fallback(
        self, request, raw_request_info, endpoint: str, route: _Route, history=None, keep=False, hand_off=False
    ):
        """Disaggregated prefill; if the handoff fails before anything reached the client,
        the decode engine prefills the prompt itself (a fresh engine request id: the
        aborted one may still be finishing)."""
        if self._mode == "pull":
            remote = self._pull_handoff(request, raw_request_info, endpoint, history, keep, hand_off)
        else:
            remote = self._pd_handle_request(request, raw_request_info)
        try:
            first = await remote.__anext__()
            failure = _server_error(first)
        except StopAsyncIteration:
            return
        except Exception as exc:  # the handoff's own failures and a dead prefill replica alike
            failure = str(exc) or type(exc).__name__
        if failure is None:
            if isinstance(first, Prefilled):
                route.prefill = HANDED_OFF
            yield first
            async for chunk in remote:
                yield chunk
            return
        await remote.aclose()
        route.prefill = "fallback"
        logger.warning("request %s: handoff failed (%s); decode prefills it locally", request.request_id, failure)
        local = request.model_copy(update={"request_id": new_transfer_request_id()})
        async for chunk in await getattr(LLMServer, endpoint)(self, local, raw_request_info):
            yield chunk

    async def _pull_handoff(self, request, raw_request_info, endpoint: str, history=None, keep=False, hand_off=False):
        """Pull: prefill first (bounded by the deadline), then decode READs its KV: here,
        or with ``hand_off`` (late binding) on the replica the ingress picks next, to which
        this one answers with a :class:`Prefilled`. With ``history``, prefill first READs
        that much of a conversation's history back from decode; with ``keep``, decode
        keeps this turn's blocks for the next turn."""
        backend = self._get_connector_backend()
        prefill_request = backend.prepare_prefill_request(request=request, peer=None)
        if history is not None:
            prefill_request.kv_transfer_params = history
        timeline = self._timelines.get(request.request_id)
        if timeline is not None:
            timeline.stamp(LEGS_SENT, time.time())
        prefill = getattr(self._prefill_handle, endpoint).remote(prefill_request, raw_request_info)
        try:
            answer = await asyncio.wait_for(prefill.__anext__(), self._prefill_timeout_s)
        except TimeoutError:
            prefill.cancel()  # prefill holds no decode resources in pull: dropping it is clean
            raise HandoffFailed(f"prefill did not answer within {self._prefill_timeout_s:g} s") from None
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
        if hand_off:
            stamps = dict(timeline.stamps) if timeline else {}  # the decoding replica goes on with them
            yield Prefilled(request.request_id, answer.kv_transfer_params, self._replica_id, stamps)
            return
        async for chunk in self._pull_decode(request, raw_request_info, endpoint, answer.kv_transfer_params, keep):
            yield chunk

    async def _pull_decode(self, request, raw_request_info, endpoint: str, prefill_params: dict, keep=False):
        """Pull: the decode leg, READing the KV that prefill's answer (``prefill_params``) points to."""
        prefill_response = types.SimpleNamespace(kv_transfer_params=prefill_params)
        decode_request = self._get_connector_backend().prepare_decode_request(
            request=request, peer=None, prefill_response=prefill_response
        )
        if keep:
            decode_request.kv_transfer_params = {**decode_request.kv_transfer_params, KEEP_HISTORY_KEY: True}
        async for chunk in await getattr(LLMServer, endpoint)(self, decode_request, raw_request_info):
            params = getattr(chunk, "kv_transfer_params", None)
            if params:
                chunk.kv_transfer_params = None  # engine addresses and block ids are not the client's business
                if keep:
                    self._kept_params[request.request_id] = params
            yield chunk

    async def _concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info, *, cancel_on_failure=True):
        """Push: decode waits for KV that only the prefill leg can produce. Ray's version
        (``PDOrchestratorMixin._concurrent_decode``, same signature) waits for it without
        a deadline; this one gives the prefill leg ``prefill_timeout_s`` and raises
        :class:`HandoffFailed` if it fails or times out before decode's first chunk. Once
        decode produced a chunk its KV has arrived, and a later prefill failure is moot."""
        timeline = self._timelines.get(decode_request.request_id)
        if timeline is not None:
            timeline.stamp(LEGS_SENT, time.time())
        prefill = asyncio.create_task(_drain_prefill(prefill_resp))
        prefill.add_done_callback(lambda task: self._prefill_done(decode_request.request_id, task))
        decode = await getattr(LLMServer, method)(self, decode_request, raw_request_info)
        chunks = decode.__aiter__()
        next_chunk = asyncio.ensure_future(chunks.__anext__())
        deadline = time.monotonic() + self._prefill_timeout_s
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
                    raise HandoffFailed(f"prefill did not finish within {self._prefill_timeout_s:g} s")
            try:
                yield next_chunk.result()
            except StopAsyncIteration:
                return
            async for chunk in chunks:
                yield chunk
            # Let the prefill response complete here: Serve's router counts it done then.
            await asyncio.wait({prefill}, timeout=self._prefill_timeout_s)
        finally:
            if not next_chunk.done():
                next_chunk.cancel()
                with contextlib.suppress(BaseException):
                    await next_chunk
            with contextlib.suppress(BaseException):
                await decode.aclose()  # aborts the engine request if it is still running
            if not prefill.done():
                # Late, not cancelled: its WRITE is what releases the blocks decode
                # registered for this request (vLLM frees an aborted decode request's
                # blocks only once its KV has arrived).
                self._late_prefills.add(prefill)
                prefill.add_done_callback(self._late_prefills.discard)

    def _prefill_done(self, request_id: str, prefill: asyncio.Task) -> None:
        """Push: keep what prefill's response reports (reuse; the engine's stage stamps)."""
        if prefill.cancelled() or prefill.exception() is not None:
            return
        params = prefill.result()[1] or {}
        timeline = self._timelines.get(request_id)
        if timeline is not None:
            timeline.stamp(PREFILL_ANSWERED, time.time())
            timeline.add_prefill_report(params.get(STAGES_KEY))
        # Only conversation turns still in flight have an entry (see _serve / _end_turn).
        if request_id in self._reuse_reports:
            self._reuse_reports[request_id] = params.get(REUSE_REPORT_KEY)

    def _prompt_token_ids(self, request) -> list[int] | None:
        return prompt_token_ids(self._tokenizer, request)

    def _vllm_config(self):
        return getattr(getattr(self.engine, "_engine_client", None), "vllm_config", None)

    def _cache_config(self):
        return self._vllm_config().cache_config

    def _max_model_len(self) -> int | None:
        return getattr(getattr(self._vllm_config(), "model_config", None), "max_model_len", None)

    def _kv_capacity_tokens(self) -> int | None:
        cache = getattr(self._vllm_config(), "cache_config", None)
        if cache is None or not cache.num_gpu_blocks:
            return None
        return cache.num_gpu_blocks * cache.block_size

    def _kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, all tensor parallel ranks together."""
        config = self._vllm_config()
        model = config.model_config
        itemsize = 1 if "fp8" in str(config.cache_config.cache_dtype) else model.dtype.itemsize
        return 2 * model.get_total_num_hidden_layers() * model.get_total_num_kv_heads() * model.get_head_size() * itemsize


class DecodeMetrics:
    """Our layer's metrics, exported through Ray's Prometheus endpoint with a ``ray_`` prefix.

    ``first_chunk_seconds`` is time to first token as the orchestrator sees it for
    streamed requests (for non-streamed ones the first chunk is the whole answer)."""

    _BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]

    def __init__(self, mode: str):
        self._tags = {"mode": mode}
        tags = ("mode", "prefill", "stream")
        self._requests = Counter(
            "rendezvous_requests",
            description="Requests served, by transfer mode, prefill path (remote = disaggregated, local = short prompt) and streaming.",
            tag_keys=tags,
        )
        self._first_chunk = Histogram(
            "rendezvous_first_chunk_seconds",
            description="Seconds from the decode replica receiving a request to its first chunk.",
            boundaries=self._BUCKETS,
            tag_keys=tags,
        )
        self._duration = Histogram(
            "rendezvous_request_seconds",
            description="Seconds from the decode replica receiving a request to its last chunk.",
            boundaries=self._BUCKETS,
            tag_keys=tags,
        )
        self._ongoing = Gauge("rendezvous_decode_ongoing_requests", description="Requests in flight on a decode replica.", tag_keys=("mode",))
        self._tokens = Gauge(
            "rendezvous_decode_tokens_in_flight",
            description="Prompt + remaining output tokens in flight on a decode replica (the router's load signal).",
            tag_keys=("mode",),
        )

        self._bindings = Counter(
            "rendezvous_decode_bindings",
            description="Requests decoded, by when their decode replica was picked: arrival, or late (pull with late "
            "binding: after prefill finished), and whether the late pick moved the request off the replica that ran "
            "its prefill leg.",
            tag_keys=("mode", "binding", "moved"),
        )
        self._turns = Counter(
            "rendezvous_conversation_turns",
            description="Conversation turns by what happened to their history: reused (prefill read it back from "
            "decode), local (decode prefilled the turn from its own cache), or why not: first_turn, expired, "
            "replica_gone, threshold, no_match, no_offer, unsupported (pull), fallback, unreported.",
            tag_keys=("mode", "history"),
        )
        self._history_tokens = Counter(
            "rendezvous_conversation_prompt_tokens",
            description="Prompt tokens of conversation turns: reused (read back from decode) or computed (by prefill, "
            "or by decode for a local turn).",
            tag_keys=("mode", "kind"),
        )
        self._kv_bytes = Counter(
            "rendezvous_conversation_kv_bytes",
            description="KV bytes of conversation turns (from token counts): d_to_p = history read back by prefill, "
            "p_to_d = new tail pushed to decode.",
            tag_keys=("mode", "direction"),
        )
        self._retained = Gauge(
            "rendezvous_conversations_retained", description="Conversations a decode replica retains.", tag_keys=("mode",)
        )

    def turn(self, history: str, reused: int, computed: int, read_back_bytes: int, pushed_bytes: int) -> None:
        self._turns.inc(tags={**self._tags, "history": history})
        for kind, tokens in (("reused", reused), ("computed", computed)):
            if tokens > 0:
                self._history_tokens.inc(tokens, tags={**self._tags, "kind": kind})
        for direction, size in (("d_to_p", read_back_bytes), ("p_to_d", pushed_bytes)):
            if size > 0:
                self._kv_bytes.inc(size, tags={**self._tags, "direction": direction})

    def retained(self, conversations: int) -> None:
        self._retained.set(conversations, tags=self._tags)

    def bound(self, binding: str, moved: bool) -> None:
        self._bindings.inc(tags={**self._tags, "binding": binding, "moved": str(moved).lower()})

    def load(self, ongoing: int, tokens: int) -> None:
        self._ongoing.set(ongoing, tags=self._tags)
        self._tokens.set(tokens, tags=self._tags)

    def finished(self, prefill: str, stream: bool, first_chunk_s: float | None, total_s: float) -> None:
        tags = {**self._tags, "prefill": prefill, "stream": str(bool(stream)).lower()}
        self._requests.inc(tags=tags)
        if first_chunk_s is not None:
            self._first_chunk.observe(first_chunk_s, tags=tags)
        self._duration.observe(total_s, tags=tags)


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


def prompt_token_ids(tokenizer, request) -> list[int] | None:
    """Prompt token ids of ``request`` as this replica renders them; None if unknown."""
    if tokenizer is None:
        return None
    try:
        if hasattr(request, "messages"):
            # return_dict=False: transformers 5 returns a BatchEncoding (2 keys) by default.
            return list(tokenizer.apply_chat_template(
                [_plain_message(m) for m in request.messages], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            ))
        prompt = request.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=False)
    except Exception:  # an unusual prompt shape: the engine will judge it
        logger.debug("could not tokenize the prompt", exc_info=True)
    return None


def _salt(request, salt: str) -> str:
    """Our prefix-cache salt, kept apart by the client's own (vLLM's ``cache_salt``) if any."""
    return f"{request.cache_salt}|{salt}" if getattr(request, "cache_salt", None) else salt


def _plain_message(message: Any) -> dict:
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text
        message["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return message


def _load_tokenizer(llm_config):
    from transformers import AutoTokenizer

    source = llm_config.model_loading_config.model_source or llm_config.model_id
    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception:
        logger.warning("no tokenizer for %s: prompt lengths unknown, every request is disaggregated", source, exc_info=True)
        return None
