"""Deadlines sized to the request's work (app/request/deadlines.py): the cost model a prefill replica learns, what
the decode replicas read of it, and the ladder it sizes."""

from __future__ import annotations

import pytest

from app.config.args import HandoffArgs
from app.request.deadlines import WINDOW, Deadlines, PrefillCost, PublishedCosts, SoloLegs
from app.routing.admission import MIN_SAMPLES
from app.routing.admission import Line


def _learned(legs) -> Line | None:
    cost = PrefillCost()
    for tokens, seconds in legs:
        cost.observe(tokens, seconds)
    return cost.line


def test_short_prompts_overhead_is_not_read_as_attention_cost():
    """Legs of 10 to 30 tokens whose time is mostly each step's overhead: a 520-token prompt is still expected in
    seconds, not minutes (a through-origin n^2 fit made it 93 s and its KV deadline outlived a 300 s client)."""
    assert _learned([(10, 0.1), (30, 0.5)] * (MIN_SAMPLES // 2)).estimate(520) < 15.0


def test_a_prefill_replica_publishes_a_cost_from_its_first_measured_leg_and_then_follows_its_recent_legs():
    cost = PrefillCost()
    assert cost.line is None
    cost.observe(500, 2.0)  # one leg: its seconds per token, not the assumption (a burst waits on it: CI)
    assert cost.line == Line(0.0, 0.004)
    cost.observe(1500, 4.0)  # fewer than the fit needs: all legs' seconds over all their tokens
    assert cost.line == Line(0.0, 0.003)
    for _ in range(MIN_SAMPLES):
        cost.observe(1000, 2.0)
    assert cost.line.estimate(1000) == pytest.approx(2.2)  # least squares over all ten
    for _ in range(WINDOW):  # the box slowed down to half speed: the old legs are forgotten
        cost.observe(1000, 4.0)
    assert cost.line.estimate(2000) == pytest.approx(8.0)
    cost.observe(0, 1.0), cost.observe(100, 0.0)  # nothing to learn from
    assert cost.line.estimate(2000) == pytest.approx(8.0)


def test_a_prefill_replica_learns_only_from_legs_that_had_its_engine_to_themselves_and_computed_all_they_hold():
    legs = SoloLegs()
    for _ in range(MIN_SAMPLES):
        ticket = legs.begin()
        legs.computed(ticket, 1000, 1000, 2.0)
        legs.end()
    assert legs.cost.line.estimate(1000) == pytest.approx(2.0) and legs.in_flight == 0
    first = legs.begin()
    second = legs.begin()  # came while the first was in flight: batched with it
    assert second is None
    legs.computed(first, 1000, 1000, 9.0)  # the first too: another started before it computed
    legs.computed(second, 1000, 1000, 9.0)
    legs.end(), legs.end()
    late = legs.begin()
    legs.computed(late, 100, 1000, 9.0)  # read 900 tokens of history back: says nothing of a 1000-token prompt
    legs.computed(late, None, None, 9.0)  # an engine that does not report them
    legs.end()
    assert legs.cost.line.estimate(1000) == pytest.approx(2.0) and legs.in_flight == 0


def test_a_decode_replica_assumes_the_cost_until_a_prefill_replica_published_one_then_reads_the_slowest():
    published = PublishedCosts()
    deadlines = Deadlines.of(HandoffArgs(assumed_prefill_tokens_per_s=25), published)
    assert deadlines.cost_s(1000) == pytest.approx(40.0) and deadlines.cost_s(0) == 0.0
    published.replace({"fast": (Line(0.0, 0.001), True), "slow": (Line(0.5, 0.002), True)})
    assert deadlines.cost_s(1000) == pytest.approx(2.5)
    published.replace({"fast": (Line(0.0, 0.001), True)})  # the slow replica is gone
    assert deadlines.cost_s(1000) == pytest.approx(1.0)
    published.replace({})
    assert deadlines.cost_s(1000) == pytest.approx(40.0)


@pytest.mark.parametrize("legs, expected_s", [
    # A first leg of 20 tokens in 1 s is mostly a step's overhead: read as 50 ms a token it would give a
    # 550-token prompt 27 s and a KV deadline past the queue deadline (CI, TP 3 -> 1). The assumption stands.
    ([(20, 1.0)], 550 / 25),
    # Long legs measured faster than the assumption: taken at once (a burst waited on the assumption: CI).
    ([(1500, 4.5), (3400, 10.0)], 550 * 14.5 / 4900),
])
def test_a_provisional_cost_is_taken_only_where_it_is_faster_than_the_assumption(legs, expected_s):
    cost = PrefillCost()
    for tokens, seconds in legs:
        cost.observe(tokens, seconds)
    assert not cost.fitted
    published = PublishedCosts()
    published.replace({"prefill": (cost.line, cost.fitted)})
    assert Deadlines.of(HandoffArgs(assumed_prefill_tokens_per_s=25), published).cost_s(550) == pytest.approx(expected_s)


def _deadlines(measured=(), **kwargs) -> Deadlines:
    """Deadlines of a decode replica whose one prefill replica measured ``measured``."""
    published = PublishedCosts()
    if (line := _learned(measured)) is not None:
        published.replace({"prefill": (line, len(measured) >= MIN_SAMPLES)})
    return Deadlines.of(HandoffArgs(**kwargs), published)


# Measured on this box (2026-12-03, a slow day): 1k tokens in 5 s, 3,398 in 29 s.
_SLOW_DAY = [(1000, 5.0), (3398, 29.0)] * (MIN_SAMPLES // 2)


@pytest.mark.parametrize("measured, own, ahead, at_least_s, at_most_s", [
    # Short prompts: the floor (prefill_timeout_s, 30 s), so a stalled engine is left within it.
    (_SLOW_DAY, 30, 0, 30.0, 30.0),
    (_SLOW_DAY, 1000, 0, 30.0, 30.0),
    # The longest prompt the default config allows, prefilled at half the measured speed (~78 s): still waited for.
    (_SLOW_DAY, 4080, 0, 2 * 39.0, 200.0),
    # Queued behind 3 such prompts on its prefill replica: their work is part of what it is expected to take.
    (_SLOW_DAY, 4080, 3 * 4080, 4 * 39.0 * 2, 600.0),
    # Nothing measured yet: the assumed 100 tokens/s, times the margin.
    ([], 4080, 0, 4080 / 100, 3 * 4080 / 100 + 1e-9),
])
def test_the_prefill_deadline_grows_with_the_work_and_never_falls_below_its_floor(measured, own, ahead, at_least_s, at_most_s):
    deadlines = _deadlines(measured)
    assert at_least_s <= deadlines.prefill_s(own, ahead) <= at_most_s


@pytest.mark.parametrize("own, ahead", [(30, 0), (1000, 0), (4080, 0), (4080, 8000), (30, 100_000)])
def test_the_kv_deadline_comes_after_the_prefill_deadline_with_the_writes_allowance(own, ahead):
    deadlines = _deadlines(_SLOW_DAY, prefill_timeout_s=30, kv_timeout_s=45)
    assert deadlines.kv_s(own, ahead) == pytest.approx(deadlines.prefill_s(own, ahead) + 15.0)


@pytest.mark.parametrize("own", [30, 1000, 2000, 4080, 16_000])
def test_a_fallback_always_comes_before_the_queue_deadline(own):
    """With nothing ahead, a remote prefill given up on at its deadline and then computed by decode
    itself (at the measured cost) still answers before the queue deadline (60 s of waiting plus the
    request's own work)."""
    deadlines = _deadlines(_SLOW_DAY)
    fallback_answers_at = deadlines.prefill_s(own) + deadlines.cost_s(own)
    queue_deadline = 60.0 + deadlines.queue_extension_s(own)
    assert fallback_answers_at < queue_deadline


def test_the_queue_deadline_grows_by_the_requests_own_work():
    """A short prompt barely moves it; a long one gets room for its own prefill on a box twice as slow."""
    deadlines = _deadlines([(1000, 5.0)] * MIN_SAMPLES)
    assert deadlines.queue_extension_s(100) < 5.0
    assert deadlines.queue_extension_s(4000) >= 2 * 20.0
