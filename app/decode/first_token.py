"""When decode's engine produced each request's first token, for answers that reach us whole.

A non-streamed answer comes out of vLLM's OpenAI layer once, after its last token, so the replica cannot see its
first token arrive. vLLM's output processor does: it notes the first token's time on the request's stats, which the
final ``RequestOutput`` carries (``metrics``: arrival time and first-token latency, both on this process's wall clock).
``FirstTokens`` watches the engine client's outputs for it, so that the request timeline's ``first_token`` and the
TTFT the replica and the admission estimate learn from are the first token's, not the last one's. Where the engine
keeps no stats (``disable_log_stats``), nothing is noted and the caller keeps its own stamp.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from connector.params import external_request_id

logger = logging.getLogger("ray.serve")

# First tokens noted and not yet taken (a request aborted before its answer, a warm-up): the oldest go first.
_KEPT = 4096


def first_token_at(output: Any) -> float | None:
    """Wall-clock time of ``output``'s request's first token (vLLM's ``RequestOutput``), or None (not out yet, or
    the engine keeps no stats)."""
    stats = getattr(output, "metrics", None)
    latency = getattr(stats, "first_token_latency", 0.0)
    return stats.arrival_time + latency if latency else None


class FirstTokens:
    def __init__(self) -> None:
        self._at: OrderedDict[str, float] = OrderedDict()

    @classmethod
    def watching(cls, engine_client: Any) -> FirstTokens:
        """Note every request's first token as ``engine_client`` (vLLM's ``AsyncLLM``) hands its outputs out."""
        first_tokens = cls()
        generate = getattr(engine_client, "generate", None)
        if generate is None:  # an upgraded Ray or vLLM (connector/seams.py lists the names)
            logger.warning("cannot watch the engine's outputs: whole answers' first tokens are stamped at their end")
            return first_tokens

        async def generate_noting_first_token(*args, **kwargs):
            async for output in generate(*args, **kwargs):
                first_tokens.note(output)
                yield output

        engine_client.generate = generate_noting_first_token
        return first_tokens

    def note(self, output: Any) -> None:
        request_id = external_request_id(getattr(output, "request_id", "") or "")
        if request_id in self._at or (at := first_token_at(output)) is None:
            return
        self._at[request_id] = at
        while len(self._at) > _KEPT:
            self._at.popitem(last=False)

    def take(self, request_id: str) -> float | None:
        """The first token's time of our ``request_id`` (once), or None."""
        return self._at.pop(request_id, None)
