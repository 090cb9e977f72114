"""A ``DecodeServer`` without an engine (``decode_server``) and the chunks a request yields from it (``drain``):
shared by the tests of the decode replica's seams, handoff, conversations and timelines."""

from __future__ import annotations

import asyncio
import types

def decode_server(local_below: int = 0, prompt_tokens: int = 5, *, mode: str = "push", late_binding: bool = False,
                  conversations=None, timeout_s: float = 30.0):
    """A DecodeServer without an engine (Ray's __init__ would start one), set up by its own
    ``_setup``; Ray's push orchestration is a stand-in that records what it was given."""
    from app.request.deadlines import Deadlines
    from app.routing.planner import PlanSettings
    from app.decode.server import DecodeServer
    from connector.params import TransferMode

    server = DecodeServer.__new__(DecodeServer)
    server.paths, server.seen, server.load, server.turns = [], [], [], []
    metrics = types.SimpleNamespace(
        load=lambda ongoing, tokens: None,
        finished=lambda prefill, stream, first, total: server.paths.append(prefill),
        bound=lambda binding, moved: None,
        turn=lambda *args: server.turns.append(args),
        retained=lambda count: None,
    )
    settings = PlanSettings(TransferMode(mode), local_below, late_binding, upstream_history=False, isolate_uncached=False)
    deadlines = Deadlines(prefill_floor_s=timeout_s, kv_after_prefill_s=15.0, margin=3.0, assumed_prefill_tokens_per_s=1e9)
    server._setup(settings, replica_id="decode-1", tokenizer=None, deadlines=deadlines,
                  conversations=conversations, metrics=metrics)
    server._prompt_token_ids = lambda request: [0] * prompt_tokens
    server._max_model_len = lambda: 4096

    async def remote(request, raw=None):
        server.seen.append((request, raw))
        server.load.append((server._ongoing, server._tokens_in_flight))
        yield "remote-chunk"

    server._pd_handle_request = remote
    return server


def drain(server, method, *args, timelines=None):
    """The chunks a request yields, as the ingress passes them on: without the request's
    timeline (appended to ``timelines`` if given)."""
    from app.request.timeline import RequestTimeline

    async def go():
        return [chunk async for chunk in await getattr(server, method)(*args)]

    chunks = asyncio.run(go())
    if timelines is not None:
        timelines.extend(c for c in chunks if isinstance(c, RequestTimeline))
    return [c for c in chunks if not isinstance(c, RequestTimeline)]
