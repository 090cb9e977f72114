"""The prefill and decode Serve deployments.

Ray Serve LLM's ``PDDecodeServer`` already does what push needs once a connector backend
asks for it: the ingress routes the request to a decode replica on arrival (through
``app.decode_router``), the decode replica binds a prefill replica (``choose_replica``)
and sends both legs concurrently. ``DecodeServer`` adds:

* a fresh, unique request id per request — vLLM pairs the two legs by that id, so it
  must never come from a client header that may repeat;
* conditional disaggregation — a prompt shorter than ``local_prefill_below_tokens`` is
  prefilled by the decode engine itself: no prefill hop, no transfer;
* the load it carries (requests and tokens in flight, KV capacity), published for the
  router through Serve's ``record_routing_stats`` hook, and counted in metrics.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import (
    PDDecodeServer,
    PDPrefillServer,
)
from ray.serve.metrics import Counter, Gauge, Histogram

from app.decode_router import STATS_KEY
from connector.params import new_transfer_request_id
from connector.ray_backend import register_backends

logger = logging.getLogger("rendezvous.servers")

# Replicas import this module when they unpickle their class; registering here makes the
# backends resolvable in every process, whoever built the app.
register_backends()

# Output budget assumed for load accounting when a request sets no max_tokens.
_DEFAULT_OUTPUT_BUDGET = 256


class PrefillServer(PDPrefillServer):
    pass


class DecodeServer(PDDecodeServer):
    async def __init__(
        self, llm_config, *, prefill_server, mode: str = "push", local_prefill_below_tokens: int = 0, **kwargs
    ):
        await super().__init__(llm_config, prefill_server=prefill_server, **kwargs)
        self._mode = mode
        self._local_below = local_prefill_below_tokens
        self._tokenizer = _load_tokenizer(llm_config)
        self._ongoing = 0
        self._tokens_in_flight = 0
        self._metrics = DecodeMetrics(mode)

    async def chat(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "chat")

    async def completions(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "completions")

    async def record_routing_stats(self) -> dict[str, Any]:
        stats = await super().record_routing_stats() or {}
        stats[STATS_KEY] = {
            "ongoing": self._ongoing,
            "tokens_in_flight": self._tokens_in_flight,
            "kv_capacity_tokens": self._kv_capacity_tokens(),
            "recorded_at": time.time(),
        }
        return stats

    async def _serve(self, request, raw_request_info, endpoint: str):
        request = request.model_copy(update={"request_id": new_transfer_request_id()})
        prompt_tokens = self._count_prompt_tokens(request)
        local = prompt_tokens < self._local_below
        path = "local" if local else "remote"
        logger.debug("request %s: %d prompt tokens, %s prefill", request.request_id, prompt_tokens, path)
        if local:
            gen = await getattr(LLMServer, endpoint)(self, request, raw_request_info)
        else:
            gen = self._pd_handle_request(request, raw_request_info)
        cost = prompt_tokens + (request.max_tokens or _DEFAULT_OUTPUT_BUDGET)
        self._ongoing += 1
        self._tokens_in_flight += cost
        self._metrics.load(self._ongoing, self._tokens_in_flight)
        started, first = time.monotonic(), None
        try:
            async for chunk in gen:
                if first is None:
                    first = time.monotonic() - started
                yield chunk
        finally:
            self._ongoing -= 1
            self._tokens_in_flight -= cost
            self._metrics.load(self._ongoing, self._tokens_in_flight)
            self._metrics.finished(path, getattr(request, "stream", False), first, time.monotonic() - started)

    def _count_prompt_tokens(self, request) -> int:
        """Prompt tokens of ``request``; unknown counts as long enough to disaggregate."""
        if self._tokenizer is None:
            return self._local_below
        try:
            if hasattr(request, "messages"):
                return len(self._tokenizer.apply_chat_template(
                    [_plain_message(m) for m in request.messages], add_generation_prompt=True, tokenize=True
                ))
            prompt = request.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return len(prompt)
            if isinstance(prompt, str):
                return len(self._tokenizer.encode(prompt, add_special_tokens=False))
        except Exception:  # an unusual prompt shape: the engine will judge it; count it as long
            logger.debug("could not count prompt tokens", exc_info=True)
        return self._local_below

    def _kv_capacity_tokens(self) -> int | None:
        config = getattr(getattr(self.engine, "_engine_client", None), "vllm_config", None)
        cache = getattr(config, "cache_config", None)
        if cache is None or not cache.num_gpu_blocks:
            return None
        return cache.num_gpu_blocks * cache.block_size


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

    def load(self, ongoing: int, tokens: int) -> None:
        self._ongoing.set(ongoing, tags=self._tags)
        self._tokens.set(tokens, tags=self._tags)

    def finished(self, prefill: str, stream: bool, first_chunk_s: float | None, total_s: float) -> None:
        tags = {**self._tags, "prefill": prefill, "stream": str(bool(stream)).lower()}
        self._requests.inc(tags=tags)
        if first_chunk_s is not None:
            self._first_chunk.observe(first_chunk_s, tags=tags)
        self._duration.observe(total_s, tags=tags)


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
