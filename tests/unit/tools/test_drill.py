"""app.tools.drill's reading of a trickle of requests (pure; the drill itself runs in test_cluster_pull.py)."""

from __future__ import annotations

import pytest

from app.tools.drill import Outcome, outage_s


def _o(started, ended, ok):
    return Outcome(started, ended, ok, "x")


@pytest.mark.parametrize("outcomes, expected", [
    ([], 0.0),
    ([_o(0, 1, True), _o(1, 2, True)], 0.0),
    # from the first failure's start to the next answer's end
    ([_o(0, 1, True), _o(1, 2, False), _o(2, 3, False), _o(3, 5, True), _o(5, 6, True)], 4.0),
    # failures apart: one outage from the first to the answer after the last
    ([_o(0, 1, False), _o(1, 2, True), _o(2, 3, False), _o(3, 4, True)], 4.0),
    # no answer after the last failure: up to the last request's end
    ([_o(0, 1, True), _o(1, 2, False), _o(2, 7, False)], 6.0),
])
def test_outage_runs_from_the_first_failure_to_the_next_answer(outcomes, expected):
    assert outage_s(outcomes) == expected
