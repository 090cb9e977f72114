"""When decode's engine produced each request's first token: in the engine core, and out of vLLM's frontend.

A non-streamed answer comes out of vLLM's OpenAI layer once, after its last token, so the replica cannot see its
first token arrive. vLLM's output processor does: it notes on the request's stats when the engine core built the
output that carried the first token (``first_token_ts``: the core's monotonic clock, the same clock on one host) and
when the frontend processed it (``arrival_time`` + ``first_token_latency``: this process's wall clock); the final
``RequestOutput`` carries those stats (``metrics``). ``FirstTokens`` watches the engine client's outputs for them:

* the request timeline's ``engine_output`` stamp, streamed or not (a stream's ``first_token`` is its first chunk);
* a whole answer's ``first_token``, and so the TTFT the replica and the admission estimate learn from: the first
  token's, not the last one's.

Where the engine keeps no stats (``disable_log_stats``), nothing is noted and the caller keeps its own stamps.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, NamedTuple

from connector.params import external_request_id

logger = logging.getLogger("ray.serve")

# First tokens noted and not yet taken (a request aborted before its answer, a warm-up): the oldest go first.
_KEPT = 4096


class FirstToken(NamedTuple):
    engine_at: float | None  # the engine core built the output with the first token (wall clock)
    frontend_at: float  # vLLM's frontend, in this process, processed it (wall clock)


def first_token_of(output: Any) -> FirstToken | None:
    """``output``'s request's first token (vLLM's ``RequestOutput``), or None (not out yet, or no stats)."""
    stats = getattr(output, "metrics", None)
    latency = getattr(stats, "first_token_latency", 0.0)
    if not latency:
        return None
    core_ts = getattr(stats, "first_token_ts", 0.0)
    engine_at = time.time() - (time.monotonic() - core_ts) if core_ts else None
    return FirstToken(engine_at, stats.arrival_time + latency)


class FirstTokens:
    def __init__(self) -> None:
        self._seen: OrderedDict[str, FirstToken] = OrderedDict()

    @classmethod
    def watching(cls, engine_client: Any) -> FirstTokens:
        """Note every request's first token as ``engine_client`` (vLLM's ``AsyncLLM``) hands its outputs out."""
        first_tokens = cls()
        generate = getattr(engine_client, "generate", None)
        if generate is None:  # an upgraded Ray or vLLM (connector/seams.py lists the names)
            logger.warning("cannot watch the engine's outputs: whole answers' first tokens are stamped at their end")
            return first_tokens

        async def generate_noting_first_token(*args, **kwargs):
            noted = False  # once per request: a stream's later outputs carry the same stats
            async for output in generate(*args, **kwargs):
                noted = noted or first_tokens.note(output)
                yield output

        engine_client.generate = generate_noting_first_token
        return first_tokens

    def note(self, output: Any) -> bool:
        """Whether ``output`` carried its request's first token (noted unless a sibling's came first: the prompts
        of one completions request share our id)."""
        if (first := first_token_of(output)) is None:
            return False
        request_id = external_request_id(getattr(output, "request_id", "") or "")
        self._seen.setdefault(request_id, first)
        while len(self._seen) > _KEPT:
            self._seen.popitem(last=False)
        return True

    def stamps(self, request_id: str, stream: bool, started: float, now: float) -> tuple[float, float | None]:
        """The replica's ``first_token`` and the engine's ``engine_output`` for a request that reached the replica at
        ``started`` and whose first chunk came ``now``: a whole answer's first token is the engine's (a stream's is
        its first chunk); a noted time outside that span is not this request's and is left out."""
        noted = self.take(request_id)
        if noted is None:
            return now, None
        first_at = noted.frontend_at if not stream and started <= noted.frontend_at <= now else now
        engine_at = noted.engine_at if noted.engine_at is not None and started <= noted.engine_at <= now else None
        return first_at, engine_at

    def take(self, request_id: str) -> FirstToken | None:
        """Our ``request_id``'s first token (once), or None."""
        return self._seen.pop(request_id, None)
