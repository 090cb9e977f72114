"""Multi-turn conversations against the real app: helpers shared by the push modules."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from bench.engine_metrics import scrape, settle, settle_quiet_s
from tests.integration.cases import Generation, long_text

MAX_TOKENS = 24
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}


@dataclass
class Conversation:
    """A chat sent turn after turn, as fast as a client would; then every turn is checked
    against a single engine given that turn's full message list. (A reference computed
    between turns could outlast a short retention on a slow box.)"""

    conversation_id: str
    messages: list[dict] = field(default_factory=lambda: [dict(SYSTEM)])
    turns: list[Generation] = field(default_factory=list)
    sent: list[list[dict]] = field(default_factory=list)  # each turn's messages, as sent

    def say(self, client, text: str) -> Generation:
        self.messages.append({"role": "user", "content": text})
        messages = [dict(m) for m in self.messages]  # a test may edit the history later
        body = {
            "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
            "return_token_ids": True, "conversation_id": self.conversation_id,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, f"{self.conversation_id} turn {len(self.turns) + 1}: {r.text}"
        payload = r.json()
        got = Generation(payload["prompt_token_ids"], payload["choices"][0]["token_ids"], payload["choices"][0]["message"]["content"])
        self.messages.append({"role": "assistant", "content": got.text})
        self.sent.append(messages)
        self.turns.append(got)
        return got

    def assert_identical(self, reference) -> None:
        for turn, (messages, got) in enumerate(zip(self.sent, self.turns), start=1):
            expected = reference.chat(messages, MAX_TOKENS)
            assert got.prompt_ids == expected.prompt_ids, f"{self.conversation_id} turn {turn}: prompts were tokenized differently"
            assert got.token_ids == expected.token_ids, (
                f"{self.conversation_id} turn {turn}: output differs from a single engine\n"
                f"  got:      {got.text!r}\n  expected: {expected.text!r}"
            )


def user_text(turn: int, sentences: int) -> str:
    return f"Part {turn}. {long_text(sentences)}\n\nWhich animal crossed river {turn + 3}?"


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ours(client) -> Counter:
    """Our conversation counters summed over replicas: (metric, label value) -> total;
    and, per replica, the turns it served: ("replica", replica id) -> turns."""
    totals = Counter()
    for name, labels, value in scrape(client.metrics.url, "ray_rendezvous_conversation"):
        if not name.startswith("ray_rendezvous_conversation"):
            continue
        label = labels.get("history") or labels.get("kind") or labels.get("direction") or ""
        totals[(name.removeprefix("ray_rendezvous_").removesuffix("_total"), label)] += value
        if name == "ray_rendezvous_conversation_turns_total":
            totals[("replica", labels.get("replica", ""))] += value
    return totals


def settled_ours(client, timeout_s: float = 90.0) -> Counter:
    """Our counters once they stopped changing: earlier turns may still be on their way
    (Ray exports metrics every few seconds). Past ``timeout_s``, the latest counters."""
    return settle(lambda: ours(client), timeout_s=timeout_s, on_timeout="return")


def wait_ours(client, predicate, timeout_s: float = 60) -> Counter:
    """Our counters once ``predicate`` holds and then stopped changing: the counter a test waits
    for can show before another one it reads, though the replica incremented both together
    (seen once in CI: a turn's tokens counted, its bytes not yet)."""
    deadline = time.monotonic() + timeout_s
    while not predicate(ours(client)) and time.monotonic() < deadline:
        time.sleep(1)
    return settled_ours(client, timeout_s=max(deadline - time.monotonic(), settle_quiet_s() * 2))


def assert_corrupted_history_is_recomputed(client, reference, conversation: Conversation, text: str) -> None:
    """One more turn whose history READ back from decode lands with a byte flipped (the test-only
    ``flip-history`` fault, ``client.kv_fault``): prefill recomputes the history, the answers stay
    identical to one engine's, and the turn counts as history="kv_mismatch", not "reused"."""
    before = settled_ours(client)
    client.kv_fault.write_text("flip-history")
    try:
        conversation.say(client, text)
    finally:
        client.kv_fault.write_text("")
    client.kv_faults_injected += 1
    conversation.assert_identical(reference)
    turns = lambda c, history: c["conversation_turns", history] - before["conversation_turns", history]  # noqa: E731
    after = wait_ours(client, lambda c: turns(c, "kv_mismatch") >= 1)
    assert (turns(after, "kv_mismatch"), turns(after, "reused")) == (1, 0), after
