"""The decode deployment's router (app/routing/decode_router.py): a request goes where the least
work is, counting what this router sent before the replicas' published load catches up."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from app.routing.decode_router import LoadAwareDecodeRouter
from app.routing.pipeline import STATS_KEY
from tests.support.routing import serve_router


def _replica(name: str, ongoing: int = 0, tokens: int = 0) -> SimpleNamespace:
    load = {"ongoing": ongoing, "tokens_in_flight": tokens, "recorded_at": 1e12}
    return SimpleNamespace(replica_id=name, routing_stats={STATS_KEY: load})


def _request(request_id: str, max_tokens: int | None, prompt: str = "x" * 80) -> SimpleNamespace:
    return SimpleNamespace(args=[SimpleNamespace(prompt=prompt, max_tokens=max_tokens), None],
                           metadata=SimpleNamespace(internal_request_id=request_id))


def _send(router, replicas, request) -> str:
    """Serve's sequence for one request: the pick, then the send to the first choice."""
    picked = asyncio.run(router.choose_replicas(replicas, request))[0][0].replica_id
    router.on_send_request(picked)
    return picked


def test_long_generations_just_sent_count_before_the_replica_publishes_them():
    """Seen in a full suite run: replica b had just been sent two long generations, a one; b's
    published load did not show them yet, a's showed its own. Counting only requests, a had fewer;
    counting the published tokens, b looked idle. The next request went to b."""
    router = serve_router(LoadAwareDecodeRouter)
    a, b = _replica("a", ongoing=1, tokens=3020), _replica("b")
    router.on_send_request("a")  # a's generation, sent long ago: the published load has it
    for i in range(2):
        assert _send(router, [b], _request(f"gen-{i}", max_tokens=3000)) == "b"
    assert _send(router, [a, b], _request("next", max_tokens=16)) == "a"


def test_a_request_counts_until_it_completes_and_once_if_picked_twice():
    router = serve_router(LoadAwareDecodeRouter)
    replicas = [_replica("a")]
    request = _request("r", max_tokens=None, prompt="x" * 400)
    _send(router, replicas, request)
    asyncio.run(router.choose_replicas(replicas, request))  # its first pick was full: picked again
    assert router._tokens_sent.as_dict() == {"a": 100 + 256}  # the prompt and decode's default budget
    router.on_request_completed("a", "r")
    assert router._tokens_sent.as_dict() == {}
