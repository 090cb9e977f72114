"""Deadlines sized to the request's work (app/deadlines.py): the cost model, and the ladder it sizes."""

from __future__ import annotations

import pytest

from app.args import HandoffArgs
from app.deadlines import WINDOW, Deadlines, Fitted, PrefillCost, fit_cost


@pytest.mark.parametrize("samples, expected", [
    ([], None),
    ([(1000, 5.0)], Fitted(0.005)),  # one length: proportional
    ([(1000, 5.0), (1100, 5.6)], Fitted((1000 * 5.0 + 1100 * 5.6) / (1000**2 + 1100**2))),  # too little spread
    ([(1000, 1.0 + 0.5), (2000, 2.0 + 2.0), (4000, 4.0 + 8.0)], Fitted(1e-3, 5e-7)),  # attention's n^2, recovered
    ([(1000, 3.0), (2000, 4.0), (4000, 6.0)], "proportional"),  # a negative n^2 term is noise
    ([(0, 1.0), (100, -1.0)], None),  # nothing measurable
])
def test_fit_cost(samples, expected):
    fitted = fit_cost(samples)
    if expected == "proportional":
        assert fitted.per_token2 == 0 and fitted.per_token > 0
    elif expected is None:
        assert fitted is None
    else:
        assert fitted.per_token == pytest.approx(expected.per_token, rel=1e-6, abs=1e-12)
        assert fitted.per_token2 == pytest.approx(expected.per_token2, rel=1e-6, abs=1e-15)


def test_the_cost_is_assumed_until_measured_and_then_follows_the_recent_legs():
    cost = PrefillCost(assumed_tokens_per_s=25)
    assert not cost.measured and cost.seconds(1000) == pytest.approx(40.0)
    cost.observe(1000, 2.0)
    assert cost.measured and cost.seconds(1000) == pytest.approx(2.0)
    for _ in range(WINDOW):  # the box slowed down to half speed: the old leg is forgotten
        cost.observe(1000, 4.0)
    assert cost.seconds(2000) == pytest.approx(8.0)
    cost.observe(0, 1.0), cost.observe(100, 0.0)  # nothing to learn from
    assert cost.seconds(0) == 0.0


def _deadlines(**kwargs) -> Deadlines:
    return Deadlines.of(HandoffArgs(**kwargs))


# Measured on this box (2026-12-03, a slow day): 1k tokens in 5 s, 3,398 in 29 s.
_SLOW_DAY = [(1000, 5.0), (3398, 29.0)]


@pytest.mark.parametrize("measured, own, ahead, at_least_s, at_most_s", [
    # Short prompts: the floor (prefill_timeout_s, 30 s), so a stalled engine is left within it.
    (_SLOW_DAY, 30, 0, 30.0, 30.0),
    (_SLOW_DAY, 1000, 0, 30.0, 30.0),
    # The longest prompt the default config allows, prefilled at half the measured speed (~78 s): still waited for.
    (_SLOW_DAY, 4080, 0, 2 * 39.0, 200.0),
    # Queued behind 3 such prompts on its prefill replica: their work is part of what it is expected to take.
    (_SLOW_DAY, 4080, 3 * 4080, 4 * 39.0 * 2, 600.0),
    # Nothing measured yet: the assumed 100 tokens/s, times the margin.
    ([], 4080, 0, 4080 / 100, 3 * 4080 / 100),
])
def test_the_prefill_deadline_grows_with_the_work_and_never_falls_below_its_floor(measured, own, ahead, at_least_s, at_most_s):
    deadlines = _deadlines()
    for tokens, seconds in measured:
        deadlines.cost.observe(tokens, seconds)
    assert at_least_s <= deadlines.prefill_s(own, ahead) <= at_most_s


@pytest.mark.parametrize("own, ahead", [(30, 0), (1000, 0), (4080, 0), (4080, 8000), (30, 100_000)])
def test_the_kv_deadline_comes_after_the_prefill_deadline_with_the_writes_allowance(own, ahead):
    deadlines = _deadlines(prefill_timeout_s=30, kv_timeout_s=45)
    for tokens, seconds in _SLOW_DAY:
        deadlines.cost.observe(tokens, seconds)
    assert deadlines.kv_s(own, ahead) == pytest.approx(deadlines.prefill_s(own, ahead) + 15.0)


@pytest.mark.parametrize("own", [30, 1000, 2000, 4080, 16_000])
def test_a_fallback_always_comes_before_the_queue_deadline(own):
    """With nothing ahead, a remote prefill given up on at its deadline and then computed by decode
    itself (at the measured cost) still answers before the queue deadline (60 s of waiting plus the
    request's own work)."""
    deadlines = _deadlines()
    for tokens, seconds in _SLOW_DAY:
        deadlines.cost.observe(tokens, seconds)
    fallback_answers_at = deadlines.prefill_s(own) + deadlines.cost.seconds(own)
    queue_deadline = 60.0 + deadlines.queue_extension_s(own)
    assert fallback_answers_at < queue_deadline


def test_the_queue_deadline_grows_by_the_requests_own_work():
    """A short prompt barely moves it; a long one gets room for its own prefill on a box twice as slow."""
    deadlines = _deadlines()
    deadlines.cost.observe(1000, 5.0)
    assert deadlines.queue_extension_s(100) < 5.0
    assert deadlines.queue_extension_s(4000) >= 2 * 20.0
