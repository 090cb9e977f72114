"""Deadlines sized to the request's work (app/deadlines.py): the cost model, and the ladder it sizes."""

from __future__ import annotations

import pytest

from app.args import HandoffArgs
from app.admission import MIN_SAMPLES
from app.deadlines import WINDOW, Deadlines, PrefillCost


def test_short_prompts_overhead_is_not_read_as_attention_cost():
    """Legs of 10 to 30 tokens whose time is mostly each step's overhead: a 520-token prompt is still expected in
    seconds, not minutes (a through-origin n^2 fit made it 93 s and its KV deadline outlived a 300 s client)."""
    cost = PrefillCost(assumed_tokens_per_s=100)
    for n, seconds in [(10, 0.1), (30, 0.5)] * (MIN_SAMPLES // 2):
        cost.observe(n, seconds)
    assert cost.seconds(520) < 15.0


def test_the_cost_is_assumed_until_measured_and_then_follows_the_recent_legs():
    cost = PrefillCost(assumed_tokens_per_s=25)
    assert not cost.measured and cost.seconds(1000) == pytest.approx(40.0)
    for _ in range(MIN_SAMPLES):
        cost.observe(1000, 2.0)
    assert cost.measured and cost.seconds(1000) == pytest.approx(2.0)
    for _ in range(WINDOW):  # the box slowed down to half speed: the old legs are forgotten
        cost.observe(1000, 4.0)
    assert cost.seconds(2000) == pytest.approx(8.0)
    cost.observe(0, 1.0), cost.observe(100, 0.0)  # nothing to learn from
    assert cost.seconds(0) == 0.0


def _deadlines(**kwargs) -> Deadlines:
    return Deadlines.of(HandoffArgs(**kwargs))


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
    for _ in range(MIN_SAMPLES):
        deadlines.cost.observe(1000, 5.0)
    assert deadlines.queue_extension_s(100) < 5.0
    assert deadlines.queue_extension_s(4000) >= 2 * 20.0
