"""What a decode replica does with one request (app.routing.planner): table-driven, starts nothing."""

from __future__ import annotations

import pytest

from app.request.envelope import Route, TurnReason
from app.routing.conversations import Turn
from app.routing.planner import UNREPORTED, UNSUPPORTED, Plan, PlanSettings, RequestFacts, plan, turn_outcome
from connector.params import ReuseReport, TransferMode

PUSH = PlanSettings(TransferMode.PUSH, local_prefill_below_tokens=64, late_binding=False, upstream_history=False,
                    isolate_uncached=False)
PULL_LATE = PlanSettings(TransferMode.PULL, 64, late_binding=True, upstream_history=False, isolate_uncached=False)
PULL_READ_BACK = PlanSettings(TransferMode.PULL, 64, late_binding=True, upstream_history=True, isolate_uncached=False)
ISOLATED = PlanSettings(TransferMode.PUSH, 64, late_binding=False, upstream_history=False, isolate_uncached=True)

HELD = Turn("c", "salt-c", reuse=True, reason=TurnReason.ATTEMPT, held_tokens=900)
NEW = Turn("c", "salt-c", reuse=False, reason=TurnReason.FIRST_TURN)


def _facts(tokens: int | None = 500, **kw) -> RequestFacts:
    return RequestFacts(request_id="rdv-1", prompt_tokens=tokens, stream=kw.pop("stream", True), turn=kw.pop("turn", None), **kw)


def _plan(route, salt=None, push_reuse=False, read_back=False, keep=False, hand_off=False) -> Plan:
    return Plan(route, salt, push_reuse, read_back, keep, hand_off)


@pytest.mark.parametrize(
    "facts, settings, expected",
    [
        # Long enough to disaggregate; short prompts are decode's own.
        (_facts(500), PUSH, _plan(Route.REMOTE)),
        (_facts(63), PUSH, _plan(Route.LOCAL)),
        (_facts(64), PUSH, _plan(Route.REMOTE)),
        # Unknown length (no tokenizer): as if long.
        (_facts(None), PUSH, _plan(Route.REMOTE)),
        # Only decode's engine can serve it (app.routing.eligibility), however long.
        (_facts(5000, alone_reason="n > 1"), PUSH, _plan(Route.LOCAL)),
        # Late binding: another replica prefilled it; it is decoded here, whatever its length.
        (_facts(10, prefilled=True), PULL_LATE, _plan(Route.REMOTE, hand_off=True)),
        (_facts(500), PULL_LATE, _plan(Route.REMOTE, hand_off=True)),
        # A conversation turn: its salt; push asks both legs to reuse what decode holds, and
        # only what lies beyond the held history (900 tokens) counts as work: 100 >= 64, 50 < 64.
        (_facts(1000, turn=HELD), PUSH, _plan(Route.REMOTE, "salt-c", push_reuse=True)),
        (_facts(950, turn=HELD), PUSH, _plan(Route.LOCAL, "salt-c", push_reuse=True)),
        (_facts(950, turn=NEW), PUSH, _plan(Route.REMOTE, "salt-c")),
        # Pull: never late-bound within a conversation; with read-back, a turn is kept for the next
        # only when not streamed (a stream never carries decode's response params).
        (_facts(1000, turn=HELD), PULL_LATE, _plan(Route.REMOTE, "salt-c")),
        (_facts(1000, turn=HELD), PULL_READ_BACK, _plan(Route.REMOTE, "salt-c", read_back=True)),
        (_facts(1000, turn=HELD, stream=False), PULL_READ_BACK, _plan(Route.REMOTE, "salt-c", read_back=True, keep=True)),
        (_facts(1000, turn=NEW, stream=True), PULL_READ_BACK, _plan(Route.REMOTE, "salt-c", read_back=True)),
        # Isolated requests get their own salt; the client's salt stays in front of ours.
        (_facts(500), ISOLATED, _plan(Route.REMOTE, "rdv-1")),
        (_facts(500, client_salt="tenant-a"), ISOLATED, _plan(Route.REMOTE, "tenant-a|rdv-1")),
        (_facts(500, client_salt="tenant-a"), PUSH, _plan(Route.REMOTE)),
    ],
)
def test_plan(facts, settings, expected):
    assert plan(facts, settings) == expected


@pytest.mark.parametrize(
    "turn, route, settings, report, outcome",
    [
        (NEW, Route.REMOTE, PUSH, None, "first_turn"),
        (Turn("c", "s", False, TurnReason.EXPIRED), Route.LOCAL, PUSH, None, "expired"),
        (HELD, Route.LOCAL, PUSH, None, "local"),
        (HELD, Route.FALLBACK, PUSH, ReuseReport("reused", 512), "fallback"),
        (HELD, Route.REMOTE, PUSH, ReuseReport("reused", 512), "reused"),
        (HELD, Route.REMOTE, PUSH, ReuseReport("no_match"), "no_match"),
        (HELD, Route.REMOTE, PUSH, None, UNREPORTED),
        (HELD, Route.REMOTE, PULL_LATE, None, UNSUPPORTED),
        (HELD, Route.REMOTE, PULL_READ_BACK, ReuseReport("threshold"), "threshold"),
    ],
)
def test_turn_outcome(turn, route, settings, report, outcome):
    said = turn_outcome(turn, route, settings, report)
    assert said == outcome and type(said) is str  # a metric label and a log word, never an enum's name


def test_reuse_reports_cross_the_wire_and_bad_ones_are_dropped():
    report = ReuseReport("reused", 512, 256, 10)
    assert ReuseReport.from_wire(report.to_wire()) == report
    assert ReuseReport.from_wire(None) is None and ReuseReport.from_wire({"reused_tokens": 5}) is None
