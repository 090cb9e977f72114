"""app.routing.admission: the TTFB model, the AIMD limit and the decisions they make (pure: no Ray, no HTTP)."""

from __future__ import annotations

import pytest

from app.routing.admission import (
    ALWAYS_ADMITTED,
    BACKOFF,
    MAX_RETRY_AFTER_S,
    MIN_SAMPLES,
    Admission,
    AimdLimit,
    Line,
    Verdict,
    fit,
)


def _line(base, slope, xs):
    return [(x, base + slope * x) for x in xs]


@pytest.mark.parametrize(
    "samples, expected",
    [
        ([(10.0, 1.0)] * (MIN_SAMPLES - 1), None),  # too few answers: no estimate
        (_line(0.5, 0.1, [1, 5, 10, 20, 40, 80, 10, 5]), Line(0.5, 0.1)),  # a clean line
        # All answers had the same work ahead: no slope to fit, TTFB taken as proportional to it.
        ([(8.0, 2.0)] * MIN_SAMPLES, Line(0.0, 0.25)),
        # Noise that fits a falling line: proportional instead (more work ahead never means faster).
        ([(1.0, 3.0), (20.0, 1.0)] * (MIN_SAMPLES // 2), Line(0.0, 4.0 / 21.0)),
        # A line through a negative base (work ahead explains more than all of it): proportional.
        (_line(-1.0, 0.2, [10, 20, 30, 40] * 2), Line(0.0, 4.0 / 25.0)),
    ],
)
def test_the_model_is_a_line_through_recent_answers_or_proportional_when_a_line_would_mislead(samples, expected):
    model = fit(samples)
    if expected is None:
        assert model is None
    else:
        assert model.base_s == pytest.approx(expected.base_s, abs=1e-9)
        assert model.slope == pytest.approx(expected.slope, rel=1e-9)


def test_aimd_grows_by_one_over_the_limit_and_cuts_at_most_once_per_cooldown():
    limit = AimdLimit(ceiling=48, value=10)
    limit.observe(1.0, slo_s=5.0, now=0.0)
    assert limit.value == pytest.approx(10.1)
    limit.observe(9.0, slo_s=5.0, now=1.0)
    assert limit.value == pytest.approx(10.1 * BACKOFF)
    limit.observe(9.0, slo_s=5.0, now=1.5)  # the same slow burst: one cut
    assert limit.value == pytest.approx(10.1 * BACKOFF)
    for _ in range(10_000):
        limit.observe(1.0, slo_s=5.0, now=2.0)
    assert limit.value == 48  # never above the ceiling
    for t in range(100):
        limit.observe(60.0, slo_s=5.0, now=10.0 + 2 * t)
    assert limit.value == 1.0 and limit.allows(0) and not limit.allows(1)
    assert AimdLimit(ceiling=48).value == 48  # no evidence, no cut: it starts where a fixed limit would be


def _learned(slo_s=10.0, base=1.0, s_per_kib=0.5, max_in_flight=48) -> Admission:
    """An admission that has seen MIN_SAMPLES answers on the line base + s_per_kib * KiB ahead."""
    admission = Admission(max_in_flight, slo_s, retry_after_s=1)
    for i in range(MIN_SAMPLES):
        kib = 1 + i
        _, ticket = admission.try_enter(int(kib * 1024), now=100.0)
        admission.answered(ticket, now=100.0 + base + s_per_kib * kib)
        admission.leave(ticket)
    assert admission.model is not None and admission.in_flight == 0
    return admission


@pytest.mark.parametrize(
    "in_flight_kib, new_kib, admitted, verdict, retry_after",
    [
        ([], 4, True, Verdict.IDLE, 0),  # nothing in flight: always admitted
        ([40], 4, True, Verdict.IDLE, 0),  # one in flight, whatever it holds: still admitted
        ([4, 4], 4, True, Verdict.ESTIMATE, 0),  # 1 + 0.5 * 12 = 7 s <= 10 s
        ([4, 4], 6, True, Verdict.ESTIMATE, 0),  # 1 + 0.5 * 14 = 8 s
        ([4, 4], 21, False, Verdict.OVER_SLO, 6),  # 1 + 0.5 * 29 = 15.5 s: retry once 5.5 s of it has drained
        ([4, 4, 4, 4], 9, False, Verdict.OVER_SLO, 4),  # 1 + 0.5 * 25 = 13.5 s
        ([400, 1], 1, False, Verdict.OVER_SLO, MAX_RETRY_AFTER_S),  # a minutes-long queue: capped
    ],
)
def test_a_request_is_admitted_if_its_expected_ttfb_is_within_the_slo(in_flight_kib, new_kib, admitted, verdict,
                                                                      retry_after):
    admission = _learned()
    for kib in in_flight_kib:
        assert admission.try_enter(kib * 1024, now=200.0)[0].admitted
    decision, ticket = admission.try_enter(new_kib * 1024, now=200.0)
    assert (decision.admitted, decision.verdict) == (admitted, verdict)
    assert (ticket is not None) == admitted
    if not admitted:
        assert decision.retry_after_s == retry_after
        assert admission.in_flight == len(in_flight_kib)  # a rejection holds nothing


def test_the_ceiling_holds_with_or_without_an_slo_and_answered_work_stops_counting_as_ahead():
    fixed = Admission(max_in_flight=2, ttft_slo_s=None)
    first, second = fixed.try_enter(1 << 20, 0.0)[1], fixed.try_enter(1 << 20, 0.0)[1]
    assert fixed.try_enter(10, 0.0)[0].verdict is Verdict.BUSY
    fixed.leave(first)
    assert fixed.try_enter(10, 0.0)[0].verdict is Verdict.UNLIMITED
    fixed.leave(second)

    admission = _learned()
    held = [admission.try_enter(8 * 1024, now=300.0)[1] for _ in range(ALWAYS_ADMITTED)]
    assert admission.try_enter(8 * 1024, now=300.0)[0].verdict is Verdict.OVER_SLO  # 1 + 0.5 * 24 = 13 s
    for ticket in held:
        admission.answered(ticket, now=301.0)  # first bytes out: decoding, no longer ahead of anyone
        admission.answered(ticket, now=302.0)  # once only
    assert admission.try_enter(8 * 1024, now=302.0)[0].verdict is Verdict.ESTIMATE  # 1 + 0.5 * 8 = 5 s
    assert admission.in_flight == ALWAYS_ADMITTED + 1


def test_without_an_estimate_the_adaptive_limit_decides_and_learns_from_slow_answers():
    admission = Admission(max_in_flight=48, ttft_slo_s=5.0)
    tickets = [admission.try_enter(1024, now=0.0)[1] for _ in range(4)]
    assert all(tickets) and admission.model is None
    for i, ticket in enumerate(tickets[:3]):
        admission.answered(ticket, now=30.0 + 2 * i)  # far beyond the SLO, cooldown apart: three cuts
        admission.leave(ticket)
    assert admission.limit.value == pytest.approx(48 * BACKOFF ** 3)
    while admission.in_flight < int(admission.limit.value):
        assert admission.try_enter(1024, now=40.0)[0].verdict in (Verdict.IDLE, Verdict.LIMIT)
    decision, ticket = admission.try_enter(1024, now=40.0)
    assert ticket is None and decision.verdict is Verdict.LIMIT and decision.retry_after_s == 1


def test_a_request_that_leaves_before_its_first_byte_teaches_nothing():
    admission = Admission(max_in_flight=4, ttft_slo_s=5.0)
    _, ticket = admission.try_enter(2048, now=0.0)
    admission.leave(ticket)  # hung up, or failed
    assert admission.in_flight == 0 and admission.model is None and admission.limit.value == 4
    assert admission.try_enter(1024, now=1.0)[0].estimate_s is None


def _learned_whole(tpot_at_one=0.1, tpot_per_request=0.05) -> Admission:
    """``_learned``'s TTFT line (1 + 0.5 s per KiB ahead), and whole answers whose time per output token
    was ``tpot_at_one + tpot_per_request * (requests in flight when admitted)``."""
    admission = _learned()
    for in_flight in range(1, MIN_SAMPLES + 1):
        tickets = [admission.try_enter(1024, now=0.0, output_tokens=11)[1] for _ in range(in_flight)]
        tpot = tpot_at_one + tpot_per_request * in_flight
        admission.answered(tickets[-1], now=2.0 + 10 * tpot, first_token_at=2.0, output_tokens=11)
        for ticket in tickets:
            admission.leave(ticket)
    assert admission.tpot_model is not None and admission.in_flight == 0
    return admission


@pytest.mark.parametrize("held, output_tokens, admitted, verdict", [
    # TTFT 1 + 0.5 * 3 = 2.5 s, then 20 tokens at 0.1 + 0.05 * 3 = 0.25 s: 7.5 s <= 10 s.
    (2, 21, True, Verdict.ESTIMATE),
    # The same prompt with 41 tokens: 2.5 + 40 * 0.25 = 12.5 s, beyond the SLO: refused, though its first token would
    # come in 2.5 s. Its client waits for the last.
    (2, 41, False, Verdict.OVER_SLO),
    (2, 0, True, Verdict.ESTIMATE),  # streamed: its first token is what it waits for
    (0, 10_000, True, Verdict.IDLE),  # nothing ahead of it: never refused for its own length
])
def test_a_whole_answer_is_admitted_by_its_expected_time_to_the_last_token(held, output_tokens, admitted, verdict):
    admission = _learned_whole()
    for _ in range(held):
        assert admission.try_enter(1024, now=100.0)[0].admitted
    decision, ticket = admission.try_enter(1024, now=100.0, output_tokens=output_tokens)
    assert (decision.admitted, decision.verdict) == (admitted, verdict), decision
    assert decision.whole == (output_tokens > 1 and not admitted)


def test_without_a_tpot_model_a_whole_answer_is_refused_by_its_ttft_alone_else_the_limit_decides():
    admission = _learned()  # TTFT learned from streams; no whole answer seen yet
    assert admission.tpot_model is None
    for _ in range(ALWAYS_ADMITTED):
        admission.try_enter(4 * 1024, now=100.0)
    assert admission.try_enter(1024, now=100.0, output_tokens=64)[0].verdict is Verdict.LIMIT  # TTFT 5.5 s: can't tell
    assert admission.try_enter(12 * 1024, now=100.0, output_tokens=64)[0].verdict is Verdict.OVER_SLO  # TTFT 15 s


def test_a_whole_answer_teaches_its_first_token_and_its_time_per_token_apart():
    admission = Admission(max_in_flight=48, ttft_slo_s=10.0)
    for _ in range(MIN_SAMPLES):
        _, ticket = admission.try_enter(1024, now=0.0, output_tokens=101)
        admission.answered(ticket, now=12.0, first_token_at=2.0, output_tokens=101)  # 2 s TTFT, then 0.1 s a token
        admission.leave(ticket)
    assert admission.model.estimate(1.0) == pytest.approx(2.0)
    assert admission.tpot_model.estimate(1.0) == pytest.approx(0.1)
    # Without its first token's time a whole answer teaches neither (its TTFB is not a TTFT).
    _, ticket = admission.try_enter(1024, now=20.0, output_tokens=101)
    admission.answered(ticket, now=40.0)
    assert admission.model.estimate(1.0) == pytest.approx(2.0)
