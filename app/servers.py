"""The prefill and decode Serve deployments.

Ray Serve LLM's ``PDDecodeServer`` already does what push needs once a connector backend
asks for it: the ingress routes the request to a decode replica on arrival (through
``app.decode_router``), the decode replica binds a prefill replica (``choose_replica``)
and sends both legs concurrently. ``DecodeServer`` adds:

* a fresh, unique request id per request — vLLM pairs the two legs by that id, so it
  must never come from a client header that may repeat;
* conditional disaggregation — a prompt shorter than ``local_prefill_below_tokens`` is
  prefilled by the decode engine itself: no prefill hop, no transfer;
* a handoff that cannot hang — the prefill leg has ``prefill_timeout_s``; if it times out
  or fails before decode produced anything, decode prefills the prompt itself
  (``fallback``) instead of waiting for KV that will never come, or failing the request;
* the load it carries (requests and tokens in flight, KV capacity), published for the
  router through Serve's ``record_routing_stats`` hook, and counted in metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import (
    PDDecodeServer,
    PDPrefillServer,
    _drain_prefill,
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


class HandoffFailed(Exception):
    """The prefill leg failed or missed its deadline before decode produced anything."""


@dataclass
class _Route:
    """How one request was served: ``local``, ``remote`` or ``fallback`` prefill."""

    prefill: str


class DecodeServer(PDDecodeServer):
    async def __init__(
        self,
        llm_config,
        *,
        prefill_server,
        mode: str = "push",
        local_prefill_below_tokens: int = 0,
        prefill_timeout_s: float = 30.0,
        **kwargs,
    ):
        await super().__init__(llm_config, prefill_server=prefill_server, **kwargs)
        self._mode = mode
        self._local_below = local_prefill_below_tokens
        self._prefill_timeout_s = prefill_timeout_s
        self._tokenizer = _load_tokenizer(llm_config)
        self._ongoing = 0
        self._tokens_in_flight = 0
        self._metrics = DecodeMetrics(mode)
        self._late_prefills: set[asyncio.Task] = set()  # kept referenced until they end

    async def chat(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "chat")

    async def completions(self, request, raw_request_info=None):
        return self._serve(request, raw_request_info, "completions")

    async def record_routing_stats(self) -> dict[str, Any]:
        # Serve calls this every routing.stats_period_s; re-setting the load gauges here keeps
        # them exported while idle (Ray exports a gauge only if it was set since the last export).
        self._metrics.load(self._ongoing, self._tokens_in_flight)
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
        route = _Route("local" if prompt_tokens < self._local_below else "remote")
        logger.debug("request %s: %d prompt tokens, %s prefill", request.request_id, prompt_tokens, route.prefill)
        if route.prefill == "local":
            gen = await getattr(LLMServer, endpoint)(self, request, raw_request_info)
        else:
            gen = self._remote_or_fallback(request, raw_request_info, endpoint, route)
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
            self._metrics.finished(route.prefill, getattr(request, "stream", False), first, time.monotonic() - started)

    async def _remote_or_fallback(self, request, raw_request_info, endpoint: str, route: _Route):
        """Disaggregated prefill; if the handoff fails before anything reached the client,
        the decode engine prefills the prompt itself (a fresh engine request id: the
        aborted one may still be finishing)."""
        if self._mode == "pull":
            remote = self._pull_handoff(request, raw_request_info, endpoint)
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

    async def _pull_handoff(self, request, raw_request_info, endpoint: str):
        """Pull: prefill first (bounded by the deadline), then decode READs its KV."""
        backend = self._get_connector_backend()
        prefill = getattr(self._prefill_handle, endpoint).remote(
            backend.prepare_prefill_request(request=request, peer=None), raw_request_info
        )
        try:
            chunk = await asyncio.wait_for(prefill.__anext__(), self._prefill_timeout_s)
        except TimeoutError:
            prefill.cancel()  # prefill holds no decode resources in pull: dropping it is clean
            raise HandoffFailed(f"prefill did not answer within {self._prefill_timeout_s:g} s") from None
        if isinstance(chunk, ErrorResponse):
            yield chunk
            return
        async for _ in prefill:  # one token: let the response complete
            pass
        decode_request = backend.prepare_decode_request(request=request, peer=None, prefill_response=chunk)
        async for chunk in await getattr(LLMServer, endpoint)(self, decode_request, raw_request_info):
            yield chunk

    async def _concurrent_decode(self, method, decode_request, prefill_resp, raw_request_info, *, cancel_on_failure=True):
        """Push: decode waits for KV that only the prefill leg can produce. Ray's version
        (``PDOrchestratorMixin._concurrent_decode``, same signature) waits for it without
        a deadline; this one gives the prefill leg ``prefill_timeout_s`` and raises
        :class:`HandoffFailed` if it fails or times out before decode's first chunk. Once
        decode produced a chunk its KV has arrived, and a later prefill failure is moot."""
        prefill = asyncio.create_task(_drain_prefill(prefill_resp))
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


def _server_error(chunk: Any) -> str | None:
    """The message of a server-side error chunk; client errors (4xx) pass through."""
    if isinstance(chunk, ErrorResponse) and chunk.error.code >= 500:
        return chunk.error.message
    return None


def _prefill_failure(prefill: asyncio.Task) -> str | None:
    try:
        result = prefill.result()
    except BaseException as exc:
        return f"prefill failed: {exc or type(exc).__name__}"
    if isinstance(result, ErrorResponse):
        return f"prefill returned {result.error.code}: {result.error.message}"
    return None


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
