"""1 prefill + 1 decode in pull mode (configs/local-cpu-pull.yaml): the baseline, conversations
included. Started with plain ``serve run`` (no wrapper of ours): its end checks that Serve's
own shutdown ends the vLLM engines, and the next module's start that the ports are free."""

from __future__ import annotations

import pytest

from tests.integration.cases import CASE_BY_NAME, CASES, STREAMED, assert_kv_travelled, assert_stream_identical, assert_token_identical
from tests.integration.conftest import app_client
from tests.integration.conversations import Conversation, settled_ours, user_text, wait_ours

CONFIG = "configs/local-cpu-pull.yaml"


@pytest.fixture(scope="module")
def client(log_dir):
    yield from app_client(CONFIG, log_dir, how="serve")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_output_is_token_identical_to_a_single_engine(client, reference, case):
    assert_token_identical(client, reference, case)


@pytest.mark.parametrize("name", STREAMED[:2])
def test_streamed_output_is_identical_to_a_single_engine(client, reference, name):
    assert_stream_identical(client, reference, CASE_BY_NAME[name])


def test_kv_was_read_by_decode_not_recomputed(client, reference):
    assert_kv_travelled(client, reference, CONFIG, writer="decode")


def test_a_conversation_keeps_its_history_on_decode_and_stays_identical(client, reference):
    """Pull: prefill recomputes every turn (reading history back is push-only, ours), but
    decode keeps the history, so a conversation works through the same API."""
    before = settled_ours(client)
    conversation = Conversation("pull")
    for turn, sentences in ((1, 30), (2, 8)):
        conversation.say(client, user_text(turn, sentences))
    conversation.assert_identical(reference)
    after = wait_ours(client, lambda c: c[("conversation_turns", "unsupported")] - before[("conversation_turns", "unsupported")] >= 1)
    assert after[("conversation_turns", "unsupported")] - before[("conversation_turns", "unsupported")] == 1
