"""The decode pick pipeline: tables of replica snapshots → expected pick."""

import random

import pytest

from app.routing.decode_router import snapshot_from_stats
from app.routing.pipeline import ReplicaSnapshot as R
from app.routing.pipeline import RouteRequest, RoutingPolicy, pick
from tests.support.routing import serve_router

DEFAULT = RoutingPolicy()
FRESH = 1.0


@pytest.mark.parametrize(
    "name, replicas, expected",
    [
        ("idle beats busy", [R("a", ongoing_requests=3, tokens_in_flight=900), R("b")], "b"),
        ("fewer tokens in flight wins at equal request counts",
         [R("a", 2, tokens_in_flight=3000), R("b", 2, tokens_in_flight=200)], "b"),
        ("a full KV cache is filtered out even when idle",
         [R("a", 0, kv_usage=0.99, stats_age_s=FRESH), R("b", 4, tokens_in_flight=500, kv_usage=0.3, stats_age_s=FRESH)], "b"),
        ("stale KV stats never exclude a replica",
         [R("a", 0, kv_usage=0.99, stats_age_s=60.0), R("b", 4, tokens_in_flight=500, kv_usage=0.3, stats_age_s=FRESH)], "a"),
        ("missing stats never exclude a replica", [R("a", 0), R("b", 1, tokens_in_flight=10, kv_usage=0.1, stats_age_s=FRESH)], "a"),
        ("unhealthy replicas are skipped", [R("a", 0, healthy=False), R("b", 5, tokens_in_flight=999)], "b"),
        ("single replica", [R("only", 9, tokens_in_flight=10_000)], "only"),
    ],
)
def test_pick_table(name, replicas, expected):
    assert pick(DEFAULT, RouteRequest(), replicas).replica_id == expected, name


def test_all_filtered_out_falls_back_to_every_candidate():
    replicas = [R("a", 1, kv_usage=0.99, stats_age_s=FRESH), R("b", 0, kv_usage=0.98, stats_age_s=FRESH)]
    decision = pick(DEFAULT, RouteRequest(), replicas)
    assert decision.fallback and decision.replica_id == "b"
    assert decision.filtered_out == {"a": "kv_room", "b": "kv_room"}


def test_ties_are_broken_at_random_over_all_tied_replicas():
    replicas = [R("a"), R("b"), R("c")]
    picks = {pick(DEFAULT, RouteRequest(), replicas, random.Random(seed)).replica_id for seed in range(50)}
    assert picks == {"a", "b", "c"}


def test_weights_change_the_pick():
    replicas = [R("a", 1, tokens_in_flight=5000), R("b", 3, tokens_in_flight=100)]
    by_requests = RoutingPolicy(scorers={"least_ongoing": 1.0})
    by_tokens = RoutingPolicy(scorers={"least_tokens": 1.0})
    assert pick(by_requests, RouteRequest(), replicas).replica_id == "a"
    assert pick(by_tokens, RouteRequest(), replicas).replica_id == "b"


def test_decision_records_every_scorer_in_range():
    decision = pick(DEFAULT, RouteRequest(), [R("a", 1, 10), R("b", 2, 20, kv_usage=0.5, stats_age_s=FRESH)])
    for per in decision.scores.values():
        assert set(per) == set(DEFAULT.scorers)
        assert all(0.0 <= v <= 1.0 for v in per.values())
    assert decision.totals[decision.replica_id] == max(decision.totals.values())


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"filters": ["healthy", "nope"]}, "unknown filter"),
        ({"scorers": {"least_ongoing": 1, "magic": 2}}, "unknown scorer"),
        ({"scorers": {"least_ongoing": 0}}, "at least one"),
        ({"typo": 1}, "Extra inputs"),
    ],
)
def test_bad_policies_fail_loudly_with_the_valid_names(raw, message):
    with pytest.raises(ValueError, match=message):
        RoutingPolicy.model_validate(raw)


def test_no_replicas_is_an_error():
    with pytest.raises(ValueError):
        pick(DEFAULT, RouteRequest(), [])


@pytest.mark.parametrize(
    "probed, stats, expected",
    [
        (None, None, R("r", 0, 0, None, True, None)),
        (3, {}, R("r", 3, 0, None, True, None)),
        (1, {"rendezvous": {"ongoing": 4, "tokens_in_flight": 500, "kv_capacity_tokens": 1000, "recorded_at": 98.0}},
         R("r", 4, 500, 0.5, True, 2.0)),
    ],
)
def test_snapshot_from_replica_stats(probed, stats, expected):
    assert snapshot_from_stats("r", probed, stats, now=100.0) == expected


def test_requests_this_router_sent_count_before_the_published_stats_catch_up():
    stale = {"rendezvous": {"ongoing": 0, "tokens_in_flight": 0, "recorded_at": 99.0}}
    assert snapshot_from_stats("r", None, stale, now=100.0, sent_here=2).ongoing_requests == 2
    assert snapshot_from_stats("r", 3, stale, now=100.0, sent_here=1).ongoing_requests == 3


def test_router_counts_what_it_sent_until_each_request_completes():
    from app.routing.decode_router import LoadAwareDecodeRouter

    router = serve_router(LoadAwareDecodeRouter)  # Serve's own queue-length cache off, as is its default
    router.on_send_request("a")
    router.on_send_request("a")
    router.on_send_request("b")
    router.on_request_completed("a", "req-1")
    router.on_request_completed("b", "req-2")
    router.on_request_completed("b", "req-3")  # a completion Serve reports twice never goes negative
    assert dict(router._sent_here) == {"a": 1}


def test_round_robin_takes_replicas_in_turn_whatever_their_load():
    import asyncio
    from types import SimpleNamespace

    from app.routing.decode_router import RoundRobinDecodeRouter

    router = serve_router(RoundRobinDecodeRouter, policy={"ignored": True})
    replicas = [SimpleNamespace(replica_id=name) for name in ("b", "a", "c")]
    firsts = [asyncio.run(router.choose_replicas(replicas))[0][0].replica_id for _ in range(4)]
    assert firsts == ["a", "b", "c", "a"]
    ranks = asyncio.run(router.choose_replicas(replicas))
    assert [r.replica_id for r in ranks[0] + ranks[1]] == ["b", "c", "a"]  # the rest, for Serve to fall through to


def test_the_routers_metrics_use_no_tag_serve_reserves():
    """Serve adds deployment/replica/application/route tags itself and raises (in a replica,
    at the first count) when a metric declares one."""
    from ray.serve import metrics as serve_metrics

    from app.routing.decode_router import _picks

    reserved = {serve_metrics.DEPLOYMENT_TAG, serve_metrics.REPLICA_TAG, serve_metrics.APPLICATION_TAG, serve_metrics.ROUTE_TAG}
    assert not set(_picks()._tag_keys) & reserved


def test_published_load_crosses_the_wire_and_tolerates_what_it_does_not_know():
    from app.routing.pipeline import STATS_KEY, PublishedLoad

    from app.routing.admission import Line

    load = PublishedLoad(3, 1200, 99.0, kv_capacity_tokens=4096, conversations=("a", "b"))
    assert PublishedLoad.read(load.publish_into({"serve": "own"})) == load
    prefill = PublishedLoad(1, 500, 99.0, prefill_cost=Line(0.2, 0.004), prefill_cost_fitted=True)
    assert PublishedLoad.read(prefill.publish_into({})) == prefill
    provisional = PublishedLoad(1, 500, 99.0, prefill_cost=Line(0.0, 0.004))
    assert PublishedLoad.read(provisional.publish_into({})) == provisional
    for junk in ("fast", {"base_s": 1.0}, {"base_s": 0.0, "s_per_token": -1.0}):
        assert PublishedLoad.read({STATS_KEY: {"prefill_cost": junk}}).prefill_cost is None
    assert PublishedLoad.read(None) is None and PublishedLoad.read({STATS_KEY: "junk"}) is None
    # A replica of an older build published fewer fields.
    assert PublishedLoad.read({STATS_KEY: {"ongoing": 1}}) == PublishedLoad(1, 0, 0.0)
