"""Short generations on each engine before its replica takes traffic.

Measured on the 2-core CPU box (push, ~250-token prompts, right after a start): the first
request that *samples* (temperature > 0) took 6.1–7.6 s against ~1.0 s for the next one,
~3 s of it in the prefill engine's step and ~3 s in decode's first step, because each
engine's sampler runs code that is prepared on its first use; vLLM's own CPU warm-up does
nothing under ``enforce_eager``. Greedy requests, the NIXL handshake and the first transfer
cost nothing visible (the first greedy disaggregated request: 1.03 s). One sampled request
with top-p warmed every sampling path tried (top-k, min-p, plain temperature); a seeded one
takes vLLM's per-request generator path, so it is warmed too. A replica is not ready
(``/ready``, Serve's routing) before its ``__init__`` returns, so warming up there keeps the
cost off user requests. On a GPU vLLM has warmed up already and this costs milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest, ErrorResponse
from ray.llm._internal.serve.core.server.llm_server import LLMServer

logger = logging.getLogger("ray.serve." + __name__)

# Long enough for a real prefill and a decode step, short enough to cost well under a second.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 6
OUTPUT_TOKENS = 2
# The sampling each warm-up generation uses, in order (see the module docstring).
SAMPLING: tuple[dict[str, Any], ...] = (
    {"temperature": 1.0, "top_p": 0.9, "top_k": 50},
    {"temperature": 1.0, "seed": 0},
)
# An engine that cannot produce two tokens in this long is broken: fail the replica's start.
TIMEOUT_S = 300.0


def warm_up_requests(model_id: str) -> list[CompletionRequest]:
    """No KV transfer params: the engine serves them alone, whatever its connector role."""
    return [
        CompletionRequest(model=model_id, prompt=PROMPT, max_tokens=OUTPUT_TOKENS, request_id=f"warmup-{uuid.uuid4().hex}",
                          **sampling)
        for sampling in SAMPLING
    ]


async def warm_up(server: LLMServer, model_id: str, role: str, *, generate: Callable | None = None,
                  timeout_s: float = TIMEOUT_S) -> float:
    """Run the warm-up generations one after the other straight on ``server``'s engine
    (``LLMServer``'s own path, past the prefill/decode wrappers); returns their seconds.
    Raises if the engine fails one or they take over ``timeout_s``. ``generate`` (request
    -> awaitable of chunks) replaces that path in unit tests."""
    generate = generate or (lambda request: LLMServer.completions(server, request, None))
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            for request in warm_up_requests(model_id):
                async for chunk in await generate(request):
                    if isinstance(chunk, ErrorResponse):
                        raise RuntimeError(f"the {role} engine failed its warm-up generation: {chunk}")
    except TimeoutError:
        raise RuntimeError(f"the {role} engine did not finish its warm-up generations in {timeout_s:.0f} s") from None
    seconds = time.monotonic() - started
    logger.info("%s engine warmed up in %.2f s (%d sampled %d-token generations)", role, seconds, len(SAMPLING),
                OUTPUT_TOKENS)
    return seconds
