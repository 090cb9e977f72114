"""The prefill deployment's router (app/routing/prefill_router.py): prefill legs go where the
fewest prompt tokens wait, counting the legs this router sent until they complete."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.routing.pipeline import RoutingPolicy
from app.request.envelope import PROMPT_TOKENS
from app.routing.prefill_router import LoadAwarePrefillRouter
from app.routing.sent_tokens import prompt_tokens_of
from tests.support.routing import serve_router


def _router(policy: dict | None = None) -> LoadAwarePrefillRouter:
    return serve_router(LoadAwarePrefillRouter, policy=policy)


def _replica(name: str, stats: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(replica_id=name, routing_stats=stats or {})


def _leg(request_id: str, tokens: int | None, prompt: str = "") -> SimpleNamespace:
    request = SimpleNamespace(request_id=request_id, prompt=prompt, **{PROMPT_TOKENS.name: tokens})
    return SimpleNamespace(args=[request, None], metadata=SimpleNamespace(internal_request_id=f"serve-{request_id}"))


def _choose(router, replicas, leg) -> str:
    return asyncio.run(router.choose_replicas(replicas, leg))[0][0].replica_id


def test_short_legs_avoid_the_replica_prefilling_a_long_prompt_until_it_completes():
    router, replicas = _router(), [_replica("a"), _replica("b")]
    busy = _choose(router, replicas, _leg("long", 4000))
    other = ({"a", "b"} - {busy}).pop()
    # Three short legs: more requests on the other replica, but far fewer tokens.
    assert [_choose(router, replicas, _leg(f"short-{i}", 100)) for i in range(3)] == [other] * 3
    router.on_request_completed(busy, "serve-long")
    assert _choose(router, replicas, _leg("next", 100)) == busy
    assert router._tokens_sent.as_dict() == {other: 300, busy: 100}


def test_published_prefill_work_of_other_routers_counts_too():
    router = _router()
    loaded = {"rendezvous": {"ongoing": 2, "tokens_in_flight": 6000, "recorded_at": 1e12}}
    assert _choose(router, [_replica("a", loaded), _replica("b")], _leg("x", 50)) == "b"


def test_a_leg_chosen_twice_counts_once():
    router, replicas = _router(), [_replica("a")]
    leg = _leg("again", 700)
    _choose(router, replicas, leg)
    _choose(router, replicas, SimpleNamespace(args=leg.args, metadata=leg.metadata))
    assert router._tokens_sent.as_dict() == {"a": 700}


def test_a_leg_that_does_not_say_its_length_is_estimated_from_its_text():
    assert prompt_tokens_of(SimpleNamespace(request_id="silent", prompt="x" * 400)) == 100
    assert prompt_tokens_of(SimpleNamespace(request_id="ids", prompt=[1, 2, 3])) == 3
    chat = SimpleNamespace(request_id="chat", prompt=None, messages=[{"role": "user", "content": "y" * 80}])
    assert prompt_tokens_of(chat) == 20


def test_the_prompt_length_travels_with_the_request_and_its_copies():
    """As the decode replica sets it and Ray's backends copy the request into each leg."""
    import pickle

    from ray.llm._internal.serve.core.configs.openai_api_models import ChatCompletionRequest, CompletionRequest

    for request in (CompletionRequest(model="m", prompt="z"), ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "z"}])):
        leg = pickle.loads(pickle.dumps(PROMPT_TOKENS.copy_with(request, 42).model_copy(deep=True)))
        assert prompt_tokens_of(leg) == 42
    assert prompt_tokens_of(SimpleNamespace(prompt="z", **{PROMPT_TOKENS.name: "42"})) == 0  # only an int counts


def test_the_default_prefill_policy_weighs_tokens_over_requests():
    from app.config.args import RoutingArgs

    policy = RoutingArgs().prefill_policy
    assert isinstance(policy, RoutingPolicy)
    assert policy.scorers["least_tokens"] > policy.scorers.get("least_ongoing", 0)
    assert "conversation" not in policy.scorers and "kv_room" not in policy.filters


def test_the_prefill_replica_publishes_the_tokens_a_leg_says_without_tokenizing_it_again():
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    from app.prefill.server import PrefillLoad

    load = PrefillLoad(tokenizer=None)  # a leg that says nothing would count 0
    seen = []

    async def engine_chunks():
        seen.append((load._legs.in_flight, load._tokens_in_flight))
        yield "chunk"

    async def run(request):
        return [chunk async for chunk in load.counted(request, engine_chunks())]

    assert asyncio.run(run(PROMPT_TOKENS.copy_with(CompletionRequest(model="m", prompt="hi"), 4000))) == ["chunk"]
    asyncio.run(run(CompletionRequest(model="m", prompt="hi")))
    assert seen == [(1, 4000), (1, 0)] and (load._legs.in_flight, load._tokens_in_flight) == (0, 0)


def test_the_pick_time_and_the_published_cost_reach_the_decode_replica_even_from_a_router_pickled_by_value():
    """Serve pickles the router's module by value (ray.serve.config: register_pickle_by_value): in the replica the
    router's functions get their own globals, so module-level state of app.routing.prefill_router would be a copy. The
    pick must land where app.decode.server reads it (app.request.envelope.PREFILL_PICKS, imported by reference)."""
    from ray import cloudpickle

    import app.routing.prefill_router as module
    from app.routing.admission import Line
    from app.config.args import HandoffArgs
    from app.request.deadlines import Deadlines
    from app.routing.pipeline import PublishedLoad
    from app.request.envelope import PREFILL_PICKS

    cloudpickle.register_pickle_by_value(module)
    try:
        choose = cloudpickle.loads(cloudpickle.dumps(LoadAwarePrefillRouter.choose_replicas))
        publish = cloudpickle.loads(cloudpickle.dumps(LoadAwarePrefillRouter._publish_costs))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert choose.__globals__ is not LoadAwarePrefillRouter.choose_replicas.__globals__  # as in a Serve replica
    published = {"rendezvous": PublishedLoad(0, 0, 1.0, prefill_cost=Line(0.25, 0.002), prefill_cost_fitted=True).publish_into({})["rendezvous"]}
    asyncio.run(choose(_router(), [_replica("a", published)], _leg("timed", 100)))
    at = PREFILL_PICKS.take_picked_at("timed")
    assert at is not None and at > 0
    assert PREFILL_PICKS.take_picked_at("timed") is None  # read once
    # What the prefill replicas published of their cost (Serve hands the router every change of their stats:
    # update_replicas) lands where the decode replica's deadlines read it.
    publish([_replica("a", published)])
    assert Deadlines.of(HandoffArgs()).cost_s(1000) == pytest.approx(2.25)
    publish([_replica("b")])  # replica "a" is gone, "b" publishes none
    assert Deadlines.of(HandoffArgs()).cost_s(1000) == pytest.approx(1000 / HandoffArgs().assumed_prefill_tokens_per_s)
