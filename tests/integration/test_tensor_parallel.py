"""Several producer (or consumer) ranks: an engine with tensor parallel 3 on one side of the
handoff and TP 1 on the other (SmolLM2 has 9 attention heads and 3 KV heads: one KV head a rank).
The KV moves per rank pair, so one request is three NIXL transfers of a third of its KV each,
posted by the side that moves the data (prefill WRITEs in push, decode READs in pull), and decode
may only start once every producer rank's share has landed: vLLM's push worker counts one
completion notification per producer rank (``pp_size * max(1, P_TP // D_TP)``), its engine
aggregates the receive over every decode rank. A share missing when decode starts would change
the greedy float32 answer, which must stay token-identical to one TP 1 engine.

All four combinations run here, on one node (push from prefill TP 3 with progressive push: each rank WRITEs its
share of every prefill chunk) (docs/cluster.md, "Several ranks", on pull into decode
TP 3 across the cluster's namespaces). KV checksums work between the TP sizes too (connector.sum_ranks):
each decode rank checks the KV-head chunks it got against its senders' sums, and KV written into
the wrong blocks is caught on every combination."""

from __future__ import annotations

import pytest
import yaml

from tests.integration.cases import (CASE_BY_NAME, assert_kv_deadline_recomputes, assert_kv_travelled, assert_token_identical,
                                     assert_wrong_kv_is_caught)
from tests.integration.apps import Client, KvFaultSwitch, running_app, with_args
from tests.integration.conversations import (Conversation, assert_corrupted_history_is_recomputed, settled_ours, user_text,
                                             wait_ours)

BASE = "configs/local-cpu.yaml"
# (mode, prefill TP, decode TP)
COMBINATIONS = [("push", 3, 1), ("push", 1, 3), ("pull", 3, 1), ("pull", 1, 3)]
# Short deadlines, so that a request whose KV never all lands is recomputed soon (push: from decode's
# registration; pull: from posting the READ).
HANDOFF = {"prefill_timeout_s": 20.0, "kv_timeout_s": 30.0, "read_timeout_s": 15.0}
KV_DEADLINE_S = {"push": HANDOFF["kv_timeout_s"], "pull": HANDOFF["read_timeout_s"]}


# Push from three prefill ranks also streams: each rank WRITEs its share of every 512-token chunk (connector.progressive).
PROGRESSIVE = ("push", 3, 1)
CHUNK_TOKENS = 512


def tp_config(log_dir, mode: str, prefill_tp: int, decode_tp: int) -> str:
    args = yaml.safe_load(open(BASE))["applications"][0]["args"]
    tp = {"prefill": prefill_tp, "decode": decode_tp}
    extra = {}
    if (mode, prefill_tp, decode_tp) == PROGRESSIVE:
        extra = {"handoff": {**HANDOFF, "progressive": True},
                 "engine_kwargs": {**args["engine_kwargs"], "max_num_batched_tokens": CHUNK_TOKENS}}
    roles = {role: {**args[role], "engine_kwargs": {"tensor_parallel_size": tp[role]}} for role in tp if tp[role] > 1}
    return with_args(BASE, log_dir, name=f"tp-{mode}-p{prefill_tp}d{decode_tp}", mode=mode, **{"handoff": HANDOFF, **extra}, **roles)


def _id(combination) -> str:
    mode, prefill_tp, decode_tp = combination
    return f"{mode}-prefill-tp{prefill_tp}-decode-tp{decode_tp}"


@pytest.fixture(scope="module")
def tp_client(request, log_dir):
    """One app per combination (tests name theirs: indirect parametrization, so pytest runs every
    test of one combination on one app start). It can be told to drop one prefill rank's WRITE
    (connector.kv_checksum's test-only fault switch, ``client.kv_fault``)."""
    mode, prefill_tp, decode_tp = request.param
    switch = KvFaultSwitch(log_dir / f"kv-fault-{_id(request.param)}")
    with running_app(tp_config(log_dir, mode, prefill_tp, decode_tp), log_dir, env=switch.env) as app:
        client = switch.attach(Client(app))
        client.combination = request.param
        yield client
        client.http.close()
        switch.assert_only_injected_mismatches(client)


@pytest.mark.parametrize("tp_client", [COMBINATIONS[0], COMBINATIONS[2]], ids=_id, indirect=True)
def test_decode_waits_for_every_producer_rank_and_recomputes_when_one_share_never_lands(tp_client, reference):
    """One of prefill's three shares never lands (test-only ``drop-rank`` fault). Push: the last
    prefill rank skips its WRITE, and decode has two of the three completion notifications it counts.
    Pull: decode never READs the last rank's share, and holds the request back though the other two
    READs are done (connector.pull_deadline). Either way decode must not start; at the KV deadline
    it recomputes the prompt (the ladder's second rung, counted as prefill="kv_deadline") and the
    answer is still token-identical. Later requests move whole again: the next test, on the same app,
    checks that every rank's share of a long prompt lands (pytest runs a module's tests in file order)."""
    deadline_s = KV_DEADLINE_S[tp_client.combination[0]]
    took = assert_kv_deadline_recomputes(tp_client, reference, "drop-rank", deadline_s)
    assert took >= deadline_s - 5, "decode cannot have started before the deadline with two of three shares"


@pytest.mark.parametrize("tp_client", COMBINATIONS, ids=_id, indirect=True)
def test_answers_are_token_identical_and_the_kv_moves_once_per_rank_pair(tp_client, reference):
    mode, prefill_tp, decode_tp = tp_client.combination
    assert_token_identical(tp_client, reference, CASE_BY_NAME["chat-short"])
    assert_kv_travelled(tp_client, reference, BASE, writer="prefill" if mode == "push" else "decode",
                        ranks=max(prefill_tp, decode_tp), chunk_tokens=CHUNK_TOKENS if tp_client.combination == PROGRESSIVE else None)
    # Checked between TP sizes: blocks moved into their neighbours' slots (test-only `shift`) are caught
    # by every decode rank, decode recomputes, and the answer is still identical. The clean requests
    # above raised no alarm (the fixture counts the log's mismatches at the end).
    assert_wrong_kv_is_caught(tp_client, reference, "shift")


@pytest.mark.parametrize("tp_client", [COMBINATIONS[0], COMBINATIONS[1]], ids=_id, indirect=True)
def test_a_conversations_history_is_read_back_and_checked_between_tp_sizes(tp_client, reference):
    """Push: prefill READs a turn's history back from decode whatever the two TP sizes; each decode rank
    offers the sums of its share, and each prefill rank checks the head chunks it READ against them.
    A clean read-back is reused (and raises no alarm: the fixture counts), a corrupted one recomputed."""
    conversation = Conversation(f"tp-history-{_id(tp_client.combination)}")
    conversation.say(tp_client, user_text(1, 45))
    before = settled_ours(tp_client)
    conversation.say(tp_client, user_text(2, 10))
    reused = lambda c: c["conversation_turns", "reused"] - before["conversation_turns", "reused"]  # noqa: E731
    assert reused(wait_ours(tp_client, lambda c: reused(c) >= 1)) == 1
    assert_corrupted_history_is_recomputed(tp_client, reference, conversation, user_text(3, 10))
