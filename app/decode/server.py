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

A stream's first chunk goes out as soon as the engine has it, not at Ray's first batching tick
(``app.replica.streaming``). It runs two short sampled generations on its engine before it takes traffic, as the prefill
server does (``app.replica.warmup``): a fresh engine's first sampled generation is seconds slower on CPU.

The requests themselves are carried out by ``app.decode.serving.DecodeServing``, which ``DecodeServer``
builds once its engine is up and passes the engine's side to (Ray's own generation, push orchestration,
prefill handle and connector backend; the engine's config).
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDDecodeServer

from app.config.args import HandoffArgs, PullHistory
from app.decode.first_token import FirstTokens
from app.decode.metrics import DecodeMetrics
from app.decode.serving import DecodeServing
from app.replica import heartbeat
from app.replica.prompts import load_tokenizer
from app.replica.serve_logs import serve_log_targets_kept
from app.replica.streaming import StreamsFirstChunkAtOnce
from app.replica.tokenization import serve_tokenization
from app.replica.warmup import warm_up
from app.request.deadlines import Deadlines
from app.request.queue_deadline import engine_has_started
from app.routing.planner import PlanSettings
from connector.params import TransferMode
from connector.ray_backend import register_backends
from connector.stages import STAMPS_PID_ENV, listen_for_decode_stamps

# Replicas import this module when they unpickle their class; registering here makes the
# backends resolvable in every process, whoever built the app.
register_backends()


class DecodeServer(StreamsFirstChunkAtOnce, PDDecodeServer):
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
        heartbeat.start()
        os.environ[STAMPS_PID_ENV] = str(os.getpid())  # before the engine starts: its processes stamp to us
        with serve_log_targets_kept():  # the engine starts here (app.replica.serve_logs)
            await super().__init__(llm_config, prefill_server=prefill_server, **kwargs)
        serve_tokenization(self.engine)  # /tokenize and /detokenize reach decode's engine (app.replica.tokenization)
        settings = PlanSettings(
            mode=TransferMode(mode),
            local_prefill_below_tokens=local_prefill_below_tokens,
            late_binding=late_binding,
            upstream_history=bool(conversations) and TransferMode(mode) is TransferMode.PULL
            and conversations.pull_history is PullHistory.UPSTREAM,
            isolate_uncached=isolate_uncached,
        )
        self._serving = DecodeServing(
            settings,
            replica_id=serve.get_replica_context().replica_id.unique_id,
            tokenizer=load_tokenizer(llm_config),
            deadlines=Deadlines.of(handoff),
            conversations=conversations,
            metrics=DecodeMetrics(mode),
            engine=lambda endpoint, request, raw: getattr(LLMServer, endpoint)(self, request, raw),
            push=lambda request, raw: self._pd_handle_request(request, raw),
            prefill=getattr(self, "_prefill_handle", None),
            backend=lambda: self._get_connector_backend(),
            vllm_config=self._vllm_config,
            engine_started=self._engine_started,
            first_tokens=FirstTokens.watching(self._engine_client()),
        )
        self._stamps_socket = listen_for_decode_stamps(self._serving.engine_stamped)
        await warm_up(self, llm_config.model_id, "decode")

    async def chat(self, request, raw_request_info=None):
        return await self._serving.chat(request, raw_request_info)

    async def completions(self, request, raw_request_info=None):
        return await self._serving.completions(request, raw_request_info)

    async def _concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info, *, cancel_on_failure=True):
        """Ray's push orchestration calls this; ours has a deadline (``app.decode.handoff``)."""
        async for chunk in self._serving.concurrent_decode(method, decode_request, prefill_resp, raw_request_info):
            yield chunk

    async def record_routing_stats(self) -> dict[str, Any]:
        return await self._serving.routing_stats(super().record_routing_stats)

    def _vllm_config(self):
        return getattr(self._engine_client(), "vllm_config", None)

    def _engine_client(self):
        return getattr(self.engine, "_engine_client", None)

    def _engine_started(self, request_id: str) -> bool:
        return engine_has_started(getattr(self._engine_client(), "output_processor", None), request_id)
