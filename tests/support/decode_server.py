"""A decode replica's requests without Ray Serve or an engine (``decode_server``: a ``DecodeServing`` given
stand-ins for the engine's side) and the chunks a request yields from it (``drain``): shared by the tests of the
decode replica's seams, handoff, conversations and timelines."""

from __future__ import annotations

import asyncio
import types


def decode_server(local_below: int = 0, prompt_tokens: int | None = 5, *, mode: str = "push", late_binding: bool = False,
                  conversations=None, timeout_s: float = 30.0, tokenizer=None, engine=None, push=None,
                  first_token=None):
    """A ``DecodeServing`` (what ``DecodeServer`` builds once its engine is up) with stand-ins for the engine's side:
    decode's own engine (``engine``; by default it answers ``local-chunk``), Ray's push orchestration (``push``; by
    default it records what it was given and answers ``remote-chunk``), when the engine had a request's first token
    (``first_token(request_id)``: an ``app.decode.first_token.FirstToken``; by default not known), an engine config
    of 4096 tokens. Every prompt
    is ``prompt_tokens`` long (None: as ``tokenizer`` counts it). It records the requests pushed (``seen``), the load
    while one is (``load``), the route each finished request took (``paths``) and the turns counted (``turns``)."""
    from app.decode.serving import DecodeServing
    from app.request.deadlines import Deadlines
    from app.routing.planner import PlanSettings
    from connector.params import TransferMode

    paths, seen, load, turns = [], [], [], []
    metrics = types.SimpleNamespace(
        load=lambda ongoing, tokens: None,
        finished=lambda prefill, stream, first, total: paths.append(prefill),
        bound=lambda binding, moved: None,
        turn=lambda *args: turns.append(args),
        retained=lambda count: None,
    )

    async def local(endpoint, request, raw=None):
        async def gen():
            yield "local-chunk"

        return gen()

    async def remote(request, raw=None):
        seen.append((request, raw))
        load.append((server._ongoing, server._tokens_in_flight))
        yield "remote-chunk"

    settings = PlanSettings(TransferMode(mode), local_below, late_binding, upstream_history=False, isolate_uncached=False)
    deadlines = Deadlines(prefill_floor_s=timeout_s, kv_after_prefill_s=15.0, margin=3.0, assumed_prefill_tokens_per_s=1e9)
    engine_config = types.SimpleNamespace(model_config=types.SimpleNamespace(max_model_len=4096), cache_config=None)
    from app.decode.first_token import FirstTokens

    first_tokens = FirstTokens()  # notes nothing: no engine here
    if first_token is not None:
        first_tokens.take = first_token
    server = DecodeServing(
        settings, replica_id="decode-1", tokenizer=tokenizer, deadlines=deadlines, conversations=conversations,
        metrics=metrics, engine=engine or local, push=push or remote, prefill=None, backend=lambda: None,
        vllm_config=lambda: engine_config, engine_started=lambda request_id: False,
        first_tokens=first_tokens,
    )
    server.paths, server.seen, server.load, server.turns = paths, seen, load, turns
    if prompt_tokens is not None:
        server._prompt_token_ids = lambda request: [0] * prompt_tokens
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
