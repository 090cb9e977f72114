"""One short generation on each engine before its replica takes traffic.

A fresh engine's first forward passes pay one-time costs: on the 2-core CPU box the first
prefill took ~1 s longer than the next ones and the first decode step ~2.3 s instead of
~0.13 s (docs/benchmarks.md), because vLLM's own CPU warm-up does nothing under
``enforce_eager``. Without this, the first user request after every start or replica
replacement paid it. A replica is not ready (``/ready``, Serve's routing) before its
``__init__`` returns, so warming up there keeps that cost off requests. On a GPU vLLM has
warmed up already and this costs milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest, ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer

logger = logging.getLogger("ray.serve.rendezvous.warmup")

# Long enough for a real prefill and a decode step, short enough to cost well under a second.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6
OUTPUT_TOKENS = 2
# An engine that cannot produce two tokens in this long is broken: fail the replica's start.
TIMEOUT_S = 300.0


def warm_up_request(model_id: str) -> CompletionRequest:
    """Greedy, no KV transfer params: the engine serves it alone, whatever its connector role."""
    return CompletionRequest(model=model_id, prompt=PROMPT, max_tokens=OUTPUT_TOKENS, temperature=0.0,
                             request_id=f"warmup-{uuid.uuid4().hex}")


async def warm_up(server: LLMServer, model_id: str, role: str, *, generate=None, timeout_s: float = TIMEOUT_S) -> float:
    """Run the warm-up straight on ``server``'s engine (``LLMServer``'s own path, past the
    prefill/decode wrappers); returns its seconds. Raises if the engine fails it.
    ``generate`` (request -> awaitable of chunks) replaces that path in unit tests."""
    generate = generate or (lambda request: LLMServer.completions(server, request, None))
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in await generate(warm_up_request(model_id)):
                if isinstance(chunk, ErrorResponse):
                    raise RuntimeError(f"the {role} engine failed its warm-up generation: {chunk}")
    except TimeoutError:
        raise RuntimeError(f"the {role} engine did not finish its warm-up generation in {timeout_s:.0f} s") from None
    seconds = time.monotonic() - started
    logger.info("%s engine warmed up in %.2f s (%d-token generation)", role, seconds, OUTPUT_TOKENS)
    return seconds
