"""The prefill Serve deployment.

``PrefillServer`` is Ray Serve LLM's ``PDPrefillServer``, publishing for the prefill routers of
the decode replicas (``app.routing.prefill_router``) its outstanding prefill work and what its engine
takes to compute a prompt (``app.request.deadlines``). It runs two short sampled generations on its
engine before it takes traffic (``app.replica.warmup``): a fresh engine's first sampled generation is
seconds slower on CPU.
"""

from __future__ import annotations

import time
from typing import Any

from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDPrefillServer

from app.replica import heartbeat
from app.replica.prompts import load_tokenizer, prompt_token_ids
from app.replica.serve_logs import serve_log_targets_kept
from app.replica.warmup import warm_up
from app.request.deadlines import SoloLegs
from app.request.envelope import PROMPT_TOKENS
from app.routing.pipeline import PublishedLoad
from connector.params import STAGES_KEY
from connector.ray_backend import register_backends
from connector.stages import PrefillStages

# Replicas import this module when they unpickle their class; registering here makes the
# backends resolvable in every process, whoever built the app.
register_backends()


class PrefillServer(PDPrefillServer):
    """Ray's prefill server, publishing for the prefill routers of the decode replicas
    (``app.routing.prefill_router``) its outstanding prefill work (the prompt tokens of the legs in
    flight here) and what its engine takes to compute a prompt (``app.request.deadlines``): a :class:`PrefillLoad`."""

    async def __init__(self, llm_config, **kwargs):
        heartbeat.start()
        with serve_log_targets_kept():  # the engine starts here (app.replica.serve_logs)
            await super().__init__(llm_config, **kwargs)
        self._load = PrefillLoad(load_tokenizer(llm_config))
        await warm_up(self, llm_config.model_id, "prefill")

    async def chat(self, request, raw_request_info=None):
        return self._load.counted(request, await super().chat(request, raw_request_info))

    async def completions(self, request, raw_request_info=None):
        return self._load.counted(request, await super().completions(request, raw_request_info))

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = await super().record_routing_stats() or {}
        return self._load.publish_into(stats)


class PrefillLoad:
    """A prefill replica's legs in flight (and their prompt tokens), counted around each leg's chunks, and
    what its engine took to compute them; without Ray or an engine (``tokenizer``: the model's, or None)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._legs = SoloLegs()
        self._tokens_in_flight = 0

    async def counted(self, request, chunks):
        # The decode replica counted them already (app.routing.prefill_router); tokenize only a leg that does not say.
        tokens = PROMPT_TOKENS.read(request)
        if tokens is None:
            tokens = len(prompt_token_ids(self._tokenizer, request) or ())
        ticket = self._legs.begin()
        self._tokens_in_flight += tokens
        try:
            async for chunk in chunks:
                report = (getattr(chunk, "kv_transfer_params", None) or {}).get(STAGES_KEY)
                if report is not None:  # the engine's, with the last chunk: when it computed the leg
                    stages = PrefillStages.from_wire(report)
                    seconds = None if None in (stages.started, stages.finished) else stages.finished - stages.started
                    self._legs.computed(ticket, stages.computed_tokens, stages.prompt_tokens, seconds)
                yield chunk
        finally:
            self._legs.end()
            self._tokens_in_flight -= tokens

    def publish_into(self, stats: dict[str, Any]) -> dict[str, Any]:
        cost = self._legs.cost
        load = PublishedLoad(self._legs.in_flight, self._tokens_in_flight, time.time(), prefill_cost=cost.line,
                             prefill_cost_fitted=cost.fitted)
        return load.publish_into(stats)
