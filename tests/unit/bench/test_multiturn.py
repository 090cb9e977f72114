"""bench/multiturn.py: the multi-turn benchmark's load, summary and report, against a mock HTTP
transport (no app, no engines)."""

from __future__ import annotations

import json
import random

import pytest

from bench.multiturn import (
    NOT_AVAILABLE,
    TurnResult,
    conversation_reuse_available,
    speedups,
    summarize,
    user_text,
    write_report,
)
from tests.support.bench import PNG_MAGIC


def test_this_build_has_conversation_reuse():
    assert conversation_reuse_available() is True
    assert "not available" in NOT_AVAILABLE


def test_conversation_reuse_is_detected_from_the_app_args():
    from pydantic import BaseModel

    class WithConversations(BaseModel):
        model: str = "m"
        conversations: dict = {}

    assert conversation_reuse_available(WithConversations) is True


def test_multiturn_summary_and_report(tmp_path):
    results = []
    for arm, cost in (("no-reuse", 100.0), ("reuse", 30.0)):
        for c in range(3):
            for turn in (1, 2, 3, 4):
                ttft = 100.0 if turn == 1 else cost * turn
                results.append(TurnResult(arm, c, turn, 500 * turn, ttft, ttft + 500, ok=True))
    results.append(TurnResult("reuse", 3, 1, None, None, None, ok=False, error="boom"))
    rows = summarize(results)
    turn4 = {r["arm"]: r for r in rows if r["turn"] == 4}
    assert turn4["no-reuse"]["ttft_p50_ms"] == 400 and turn4["reuse"]["ttft_p50_ms"] == 120
    assert turn4["reuse"]["prompt_tokens_mean"] == 2000
    assert [r["failed"] for r in rows if r["arm"] == "reuse" and r["turn"] == 1] == [1]
    assert speedups(rows)[4] == pytest.approx(400 / 120)
    paths = write_report(tmp_path, results, rows, {"conversation_reuse_available": True})
    assert [p.name for p in paths] == ["multiturn.json", "multiturn.csv", "multiturn_ttft.png"]
    assert paths[2].read_bytes().startswith(PNG_MAGIC)
    assert json.loads(paths[0].read_text())["speedup_no_reuse_over_reuse"]["4"] == pytest.approx(400 / 120)


def test_multiturn_baseline_only_has_no_speedup():
    rows = summarize([TurnResult("no-reuse", 0, t, 10, 5.0, 9.0, ok=True) for t in (1, 2)])
    assert speedups(rows) == {} and {r["arm"] for r in rows} == {"no-reuse"}


def test_user_text_has_about_the_asked_tokens():
    class Tok:
        vocab_size = 5000

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    text = user_text(Tok(), 50, random.Random(0))
    assert len(text.split()) == 50
    assert text == user_text(Tok(), 50, random.Random(0))


def test_run_arm_grows_the_history_and_sends_conversation_id_only_when_reusing():
    import httpx

    from bench.multiturn import run_arm

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = len(body["messages"])
        events = [
            {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"delta": {"content": f"answer{n}"}}]},
            {"choices": [], "usage": {"prompt_tokens": 100 * n, "completion_tokens": 1}},
        ]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    class Tok:
        vocab_size = 1000

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    http = httpx.Client(base_url="http://app", transport=httpx.MockTransport(handler))
    plain = run_arm(http, Tok(), "m", "no-reuse", conversations=1, turns=3, turn_tokens=5, output_len=4)
    reused = run_arm(http, Tok(), "m", "reuse", conversations=1, turns=3, turn_tokens=5, output_len=4)
    assert [len(b["messages"]) for b in seen] == [1, 3, 5] * 2
    assert seen[2]["messages"][1] == {"role": "assistant", "content": "answer1"}
    assert [b["messages"][0] for b in seen[:3]] == [b["messages"][0] for b in seen[3:]]  # same conversations
    assert all("conversation_id" not in b for b in seen[:3])
    assert len({b["conversation_id"] for b in seen[3:]}) == 1
    assert all(r.ok and r.ttft_ms is not None for r in plain + reused)
    assert [r.prompt_tokens for r in plain] == [100, 300, 500]
    assert seen[0]["max_tokens"] == 4 and seen[0]["stream"] is True


def test_run_arm_stops_a_conversation_at_an_error():
    import httpx

    from bench.multiturn import run_arm

    http = httpx.Client(base_url="http://app", transport=httpx.MockTransport(lambda r: httpx.Response(400, text="bad")))

    class Tok:
        vocab_size = 1000

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    results = run_arm(http, Tok(), "m", "no-reuse", conversations=2, turns=3, turn_tokens=5, output_len=4)
    assert [(r.conversation, r.turn, r.ok) for r in results] == [(0, 1, False), (1, 1, False)]
    assert "HTTP 400" in results[0].error
