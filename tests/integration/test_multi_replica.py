"""1 prefill : 2 decode on one box (configs/local-cpu-1p2d.yaml): per-replica ports and
engine ids never clash, both decode replicas serve token-identical answers, the decode
pick is load-aware, short prompts are prefilled locally (no transfer), and every turn of
a conversation goes to the replica holding it until its retention (short here) ends.

The config pushes progressively (handoff.progressive, 512-token prefill chunks): prefill
WRITEs each chunk's KV while the next computes, so every disaggregated answer here, each
conversation turn included, is also a check of progressive push; the faults of a chunk
WRITE and of a late registration are at the end."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading
import time
from collections import Counter

import httpx
import pytest
import yaml

from app.tools.procs import BASE_URL
from bench.engine_metrics import counted_by, delta, samples_named, scrape, settle, settle_quiet_s
from bench.faults import healthy_replicas, wait_replaced, worker_pid
from bench.openloop import body_for
from bench.profiles import app_args_of, load_config
from tests.integration.cases import (
    CASE_BY_NAME, CASES, Case, answered_under_fault, assert_token_identical, logged_timelines, long_text, new_timelines,
    parse_generation,
)
from tests.integration.apps import EngineGauges, KvFaultSwitch, app_client, with_args
from tests.integration.conversations import Conversation, settled_ours, user_text, wait_ours
from tests.integration.redeploy import SteadyTraffic, deployment_named, redeploy, replica_ids, with_deployment_options

CONFIG = "configs/local-cpu-1p2d.yaml"
CHUNK_TOKENS = app_args_of(load_config(CONFIG)).engine_kwargs["max_num_batched_tokens"]  # prefill's chunk
RETENTION_S = 30  # long enough for a turn on a slow CI box, short enough to wait out


QUEUE_DEADLINE_S = 20.0  # short enough for a burst to outlast it, long enough for any single request here


@pytest.fixture(scope="module")
def client(log_dir):
    # No TTFT target: the burst of the queue-deadline test is admitted whole (max_in_flight is the rule).
    ingress = {"queue_deadline_s": QUEUE_DEADLINE_S, "ttft_slo_s": None}
    yield from app_client(with_args(CONFIG, log_dir, conversations={"retention_s": RETENTION_S}, ingress=ingress), log_dir,
                          switch=KvFaultSwitch(log_dir / "kv-fault"))


_HANDLED = ("ray_serve_deployment_request_counter_total", "ray_serve_deployment_error_counter_total")


def handled_by_replica(client, deployment: str) -> Counter:
    """Requests each replica of ``deployment`` finished, ok or not (Serve's own exact counters)."""
    counts = Counter()
    for name, labels, value in scrape(client.metrics.url, *_HANDLED):
        if name in _HANDLED and labels.get("deployment", "").startswith(deployment):
            counts[labels["replica"]] += value
    return counts


def settled_handled(client, deployment: str) -> Counter:
    """Serve's counters once they stopped changing: a fresh scrape can still lack the
    last requests (Ray exports metrics every few seconds)."""
    return settle(lambda: handled_by_replica(client, deployment), timeout_s=120.0, on_timeout="return")


def wait_handled(client, deployment: str, before: Counter, total: int, timeout_s: float = 90) -> Counter:
    deadline = time.monotonic() + timeout_s
    while True:
        grown = handled_by_replica(client, deployment) - before
        if sum(grown.values()) >= total or time.monotonic() > deadline:
            return grown
        time.sleep(1)


def test_requests_reach_both_decode_replicas_and_stay_identical(client, reference):
    before = settled_handled(client, "Decode")
    # Under local_prefill_below_tokens, so quick; the disaggregated path is what the tests below check.
    cases = [CASE_BY_NAME["completion-short"], CASE_BY_NAME["completion-1-token"]] * 6
    for case in cases:
        assert_token_identical(client, reference, case)
    grown = wait_handled(client, "Decode", before, len(cases))
    assert sum(grown.values()) == len(cases)
    assert len(grown) == 2, f"only decode replicas {dict(grown)} served requests"


@pytest.mark.parametrize("case", [c for c in CASES if "long" in c.name], ids=lambda c: c.name)
def test_long_prompts_are_token_identical(client, reference, case):
    assert_token_identical(client, reference, case)


def test_new_requests_avoid_the_decode_replica_busy_with_a_long_generation(client, reference):
    before = settled_handled(client, "Decode")
    long_done, first_chunk = threading.Event(), threading.Event()
    body = {"prompt": "Count from one to one thousand:", "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}

    def long_generation():
        # Streamed, so the test can end it (a client disconnect aborts it) instead of waiting for it.
        with client.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                first_chunk.set()
                if line.strip() == "data: [DONE]":
                    long_done.set()
                if stop.is_set():
                    return

    # Prompts under local_prefill_below_tokens: quick (no prefill hop), so they finish well
    # before the long generation does even on a slow box. Their expected answers first, so
    # the reference engine does not compete with the long generation for the cores.
    shorts = [CASE_BY_NAME["completion-short"], CASE_BY_NAME["completion-1-token"]] * 2
    for case in shorts:
        case.reference(reference)
    stop = threading.Event()
    worker = threading.Thread(target=long_generation)
    worker.start()
    assert first_chunk.wait(120), "the long generation never started streaming"
    time.sleep(3)  # the busy replica's published stats (every second) now show it
    try:
        for case in shorts:
            assert_token_identical(client, reference, case)
        assert not long_done.is_set(), "the long generation ended too early for this test to mean anything"
    finally:
        stop.set()
        worker.join(timeout=60)
    # The aborted long generation counts as a (cancelled) error on its replica.
    grown = wait_handled(client, "Decode", before, len(shorts) + 1)
    assert sorted(grown.values()) == [1, len(shorts)], (
        f"requests per decode replica {dict(grown)}: the busy one should have handled only its long generation"
    )


class _Expiring:
    """A conversation whose second turn comes after its retention ended: its first turn is said here, before
    the tests that pass the time (pytest runs a module's tests in file order), its second by the retention test."""

    def __init__(self):
        self.conversation, self.said_at = Conversation("expiring"), None

    def first_turn(self, client) -> None:
        before = settled_ours(client)
        self.conversation.say(client, user_text(1, 30))
        self.said_at = time.monotonic()
        after = wait_ours(client, lambda c: _counted(c, before, "first_turn") >= 1)
        assert _counted(after, before, "first_turn") == 1, after


EXPIRING = _Expiring()


def test_a_conversations_first_turn_is_counted_and_its_retention_starts(client):
    EXPIRING.first_turn(client)


def test_short_prompts_are_prefilled_locally_long_ones_remotely(client, reference):
    """local_prefill_below_tokens: 16 in the config."""
    metrics = client.metrics
    prefill_before = settled_handled(client, "Prefill")
    short = CASE_BY_NAME["completion-short"]  # 5 tokens
    for _ in range(3):
        assert_token_identical(client, reference, short)
    time.sleep(settle_quiet_s())  # an export interval and a margin: a remote prefill would show by now
    assert sum((handled_by_replica(client, "Prefill") - prefill_before).values()) == 0, "short prompts reached prefill"

    before, seen = metrics.settled_snapshot(), len(logged_timelines(client))
    got = assert_token_identical(client, reference, CASE_BY_NAME["completion-long"])
    # Progressive push: a WRITE for each chunk prefill computed after decode's registration came, then the last.
    # Its timeline counts the chunk WRITEs that landed on decode while prefill still computed (`streamed`); prefill's
    # engine counts every WRITE, the last one too (waited for: Ray exports the counter a few seconds late).
    steps = -(-len(got.prompt_ids) // CHUNK_TOKENS)
    (timeline,) = new_timelines(client, seen)
    writes = timeline.chunk_writes + 1
    assert 2 <= writes <= steps, (writes, steps)
    after = metrics.wait_for(lambda s: delta(s, before, "prefill", "nixl_xfer_time_seconds_count") >= writes)
    assert delta(after, before, "prefill", "nixl_xfer_time_seconds_count") == writes
    stamps = timeline.stamps
    assert stamps["prefill_started"] < stamps["first_chunk_landed"] < stamps["prefill_finished"] <= stamps["kv_landed"], stamps
    assert timeline.stages()["streamed"] > 0


def _several_chunks(fault: str) -> Case:
    """A prompt of four prefill chunks, for a test-only progressive-push fault."""
    return Case(f"progressive-{fault}", prompt=f"Progressive push ({fault}).\n" + long_text(120) + "\nNote 3 says")


def test_a_failed_chunk_write_makes_decode_recompute_at_once_and_is_counted(client, reference):
    """connector.progressive: the second chunk WRITE of a leg fails (test-only ``fail-chunk``): prefill posts no last
    WRITE and tells decode at once, which recomputes the prompt (prefill path kv_failed), long before the KV's
    deadline (a failure there would count as kv_deadline); nothing is decoded from the part of the KV that landed."""
    grown, _ = answered_under_fault(client, reference, _several_chunks("fail-chunk"), "fail-chunk", "kv_failed")
    assert dict(grown) == {"kv_failed": 1}, dict(grown)


def test_a_registration_that_comes_after_prefill_gets_everything_computed_in_one_write(client, reference):
    """connector.progressive: decode's registration held on prefill until the leg has finished (test-only
    ``late-registration``): the chunks computed meanwhile go in one WRITE, then the last one: two WRITEs."""
    engines_before = client.metrics.settled_snapshot()
    grown, _ = answered_under_fault(client, reference, _several_chunks("late-registration"), "late-registration", "remote")
    writes = delta(client.metrics.settled_snapshot(), engines_before, "prefill", "nixl_xfer_time_seconds_count")
    assert dict(grown) == {"remote": 1} and writes == 2, (dict(grown), writes)


def _counted(after, before, history: str) -> float:
    return after[("conversation_turns", history)] - before[("conversation_turns", history)]


def test_every_turn_of_a_conversation_goes_to_the_replica_holding_it(client, reference):
    """A turn on the other replica would find nothing held there (history: replica_gone)."""
    before = settled_ours(client)
    conversation = Conversation("affinity")
    for turn, sentences in ((1, 30), (2, 8), (3, 8)):
        conversation.say(client, user_text(turn, sentences))
    conversation.assert_identical(reference)
    after = wait_ours(client, lambda c: sum(_counted(c, before, h) for h in ("first_turn", "reused", "replica_gone")) >= 3)
    assert (_counted(after, before, "first_turn"), _counted(after, before, "reused")) == (1, 2), after
    assert _counted(after, before, "replica_gone") == 0


def test_a_turn_after_retention_ended_is_served_in_full_and_correct(client, reference):
    """The conversation's first turn was said by the test that ``EXPIRING`` names, earlier in the module: the tests
    between wait out most of its retention, so this one sleeps only what is left (alone, it says turn 1 itself)."""
    if EXPIRING.said_at is None:
        EXPIRING.first_turn(client)
    time.sleep(max(0.0, EXPIRING.said_at + RETENTION_S + 2 - time.monotonic()))
    before = settled_ours(client)
    EXPIRING.conversation.say(client, user_text(2, 10))
    EXPIRING.conversation.assert_identical(reference)
    after = wait_ours(client, lambda c: _counted(c, before, "expired") >= 1)
    assert (_counted(after, before, "first_turn"), _counted(after, before, "expired")) == (0, 1), after
    assert after[("conversation_prompt_tokens", "reused")] == before[("conversation_prompt_tokens", "reused")]


def turns_on(client, replica: str, history: str) -> float:
    """Conversation turns one replica served with ``history`` (ours() sums over replicas)."""
    return sum(
        value for labels, value in samples_named(client.metrics.url, "ray_rendezvous_conversation_turns_total")
        if labels.get("replica") == replica and labels.get("history") == history
    )


def wait_turns_on(client, replica: str, expected: dict[str, float], timeout_s: float = 60) -> None:
    """Wait until ``replica`` counted ``expected`` turns by history (Ray exports every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while (got := {h: turns_on(client, replica, h) for h in expected}) != expected:
        assert time.monotonic() < deadline, f"turns counted on {replica}: {got}, expected {expected}"
        time.sleep(1)


def _decode_lost(client) -> Counter:
    """The ingress's count of requests whose decode replica was lost, by when."""
    return counted_by(client.metrics.url, "ray_rendezvous_decode_lost_total", "when")


def _stream_then_kill(client, body: dict, pid: int) -> list[str]:
    """Stream ``body``; SIGKILL ``pid`` after the first event; return every event's data."""
    events = []
    with client.http.stream("POST", "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 1:
                os.kill(pid, signal.SIGKILL)
    return events


def test_whole_answers_not_started_by_the_queue_deadline_are_503_and_aborted(client, reference):
    """Non-streamed (app.request.queue_deadline): a long generation from a short prompt starts at once and
    runs well past the queue deadline: it is answered in full. Then a burst of long prompts that the
    one 2-core prefill engine needs minutes for: those whose first token is not out by the deadline
    get 503 with Retry-After, are counted as expired and are aborted on every engine (afterwards no
    engine holds a request or a KV block). Every 200 is correct (teacher forcing: batched).

    The deadline is the setting's wait plus the request's own work: (deadline_margin + 1) times its
    expected prefill (app.request.deadlines). One burst prompt alone first says what that prefill takes here."""
    long_run = Case("long-run", prompt="Count from one to one thousand:")
    burst = Case("burst", prompt="Request {i}. " + long_text(240) + "\nWhich animal crossed river 3?")  # ~3k tokens
    bodies = [(long_run, {**long_run.body(max_tokens=600), "ignore_eos": True})]
    bodies += [(burst, body_for(burst.body(max_tokens=8), i)) for i in range(12)]
    sent = time.monotonic()
    alone = client.post("/v1/completions", json=body_for(burst.body(max_tokens=8), 99))
    alone_s = time.monotonic() - sent
    assert alone.status_code == 200, alone.text
    own_work_s = (app_args_of(load_config(CONFIG)).handoff.deadline_margin + 1) * alone_s
    expired_before = _expired(client)

    def post(item):
        index, (case, body) = item
        time.sleep(0 if index == 0 else 1.0)  # the long generation first: it starts before the burst arrives
        sent = time.monotonic()
        r = http.post("/v1/completions", json=body)
        return case, r, time.monotonic() - sent

    with EngineGauges(client, ("prefill", "decode")) as gauges:
        with httpx.Client(base_url=BASE_URL, timeout=300) as http, cf.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(post, enumerate(bodies)))
        # Prefill drops the aborted legs at once; decode's blocks registered for them expire (handoff.kv_timeout_s).
        gauges.wait_idle(timeout_s=app_args_of(load_config(CONFIG)).handoff.kv_timeout_s + 30)
    statuses = Counter(r.status_code for _, r, _ in answers)
    assert set(statuses) <= {200, 503}, [r.text[:200] for _, r, _ in answers if r.status_code not in (200, 503)]
    _, first, took = answers[0]
    assert first.status_code == 200 and took > QUEUE_DEADLINE_S, (
        f"the long generation: {first.status_code} after {took:.1f} s (it started at once: it must run to its end)")
    expired = [(r, took) for _, r, took in answers if r.status_code == 503]
    assert expired, f"{dict(statuses)}: the burst should outlast the queue deadline"
    for r, took in expired:
        assert int(r.headers["retry-after"]) > 0 and "queue deadline" in r.json()["error"]["message"], r.text
        assert QUEUE_DEADLINE_S - 1 < took < QUEUE_DEADLINE_S + own_work_s + 15, (
            f"a 503 after {took:.1f} s (the prompt alone took {alone_s:.1f} s)")
    generations = [parse_generation(case, r.json()) for case, r, _ in answers if r.status_code == 200]
    gaps = reference.teacher_forcing_gaps([(g.prompt_ids, g.token_ids) for g in generations])
    assert all(max(g) <= 1.0 for g in gaps), f"tokens more than 1 nat below the reference argmax: {gaps}"
    counted, waited = _expired(client) - expired_before, time.monotonic()
    while counted < len(expired) and time.monotonic() - waited < 30:  # Ray exports metrics every few seconds
        time.sleep(1)
        counted = _expired(client) - expired_before
    assert counted == len(expired), f"{len(expired)} answered 503 at the deadline, {counted} counted as expired"


def _expired(client) -> float:
    return sum(value for _, value in samples_named(client.metrics.url, "ray_rendezvous_ingress_expired_total"))


@pytest.mark.slow
def test_killed_decode_replicas_lose_no_request_and_their_conversation_goes_on(client, reference):
    """SIGKILL the decode replica holding a conversation while it streams a turn: the stream
    ends with an error event (no hang, no cut connection); the conversation's next turn is
    served in full by the other replica (history: replica_gone) and is correct, the turn
    after reuses history there; Serve replaces the killed replica and the app serves on.
    Then kill the new holder before a turn's answer: the ingress retries it elsewhere."""
    replicas = healthy_replicas(client.metrics.url, "Decode")
    assert len(replicas) == 2, replicas
    before, lost_before = settled_ours(client), _decode_lost(client)
    conversation = Conversation("orphaned")
    conversation.say(client, user_text(1, 30))
    served = wait_ours(client, lambda c: sum(c[("replica", r)] - before[("replica", r)] for r in replicas) >= 1)
    holder = next(r for r in replicas if served[("replica", r)] > before[("replica", r)])
    survivor = next(r for r in replicas if r != holder)

    # The same conversation, so affinity routes it to the holder; long enough to be killed mid-way.
    body = {"messages": conversation.messages + [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True, "conversation_id": "orphaned"}
    events = _stream_then_kill(client, body, worker_pid(replicas[holder]))
    assert events[-1] == "[DONE]" and len(events) >= 3, events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and error["type"] == "server_error", error

    gone = turns_on(client, survivor, "replica_gone")
    conversation.say(client, user_text(2, 8))
    reused = turns_on(client, survivor, "reused")
    conversation.say(client, user_text(3, 8))
    conversation.assert_identical(reference)
    wait_turns_on(client, survivor, {"replica_gone": gone + 1, "reused": reused + 1})

    replaced = wait_replaced(client.metrics.url, "Decode", gone={holder}, count=2)
    for case in (CASE_BY_NAME["completion-short"], CASE_BY_NAME["completion-long"]):
        assert_token_identical(client, reference, case)

    # Now kill the conversation's new holder before turn 4's answer: nothing reached the
    # client yet, so the ingress retries the request once, on Serve's replacement replica.
    newcomer = next(iter(replaced - {survivor}))
    gone = turns_on(client, newcomer, "replica_gone")
    pid = worker_pid(replicas[survivor])
    with cf.ThreadPoolExecutor(1) as pool:
        turn = pool.submit(conversation.say, client, user_text(4, 8))
        time.sleep(0.5)  # the turn is on its way through prefill on the survivor
        os.kill(pid, signal.SIGKILL)
        turn.result()
    conversation.assert_identical(reference)
    wait_turns_on(client, newcomer, {"replica_gone": gone + 1})
    wait_replaced(client.metrics.url, "Decode", gone={holder, survivor}, count=2)
    assert _decode_lost(client) - lost_before == Counter({"mid_stream": 1, "before_first_chunk": 1})


@pytest.mark.slow
def test_the_app_changed_in_place_under_steady_traffic_loses_no_request(client, reference, log_dir):
    """An operator's changes to the running app, `serve deploy` of a changed config (docs/runbook.md), while whole
    and streamed completions and a conversation's turns keep coming. Serve 2.60 hashes an app's args into its code
    version, so any change there, here an ingress-only setting, replaces every replica: the ingress (beside its
    successor: ingress.max_surge_percent), then prefill's and each decode's, one at a time. The replica count is an
    option Serve changes in place (the config's `deployments`): decode 2 -> 1 -> 2. Every request is answered
    correctly (teacher forcing: batched) or refused with a retryable status and Retry-After, or, a stream, ended by
    an error event; none is cut or hangs. A conversation whose decode replica went is answered in full
    (history="replica_gone"), and the app serves on."""
    raw = yaml.safe_load(open(client.app.config))
    args = raw["applications"][0]["args"]
    decode = deployment_named(client.app, "Decode")
    # Named under `deployments` from this rollout on: the first time Serve 2.60 sees a deployment named there it
    # rebuilds its actor options and replaces its replicas, and this rollout replaces them anyway (docs/runbook.md).
    ingress_only = with_args(client.app.config, log_dir, name="local-cpu-1p2d-redeployed",
                             ingress={**args.get("ingress", {}), "max_body_bytes": 4 << 20})
    changed = with_deployment_options(ingress_only, log_dir / "redeployed-2.yaml", **{decode: {"num_replicas": 2}})
    before = settled_ours(client)
    took = {}
    with SteadyTraffic("redeploy") as traffic:
        _wait_for(lambda: min(traffic.count(kind) for kind in ("whole", "stream", "turn")) >= 1, "traffic to flow")
        took["args (every replica replaced)"] = redeploy(client.app, changed)
        two = replica_ids(client.app, decode)
        one = with_deployment_options(changed, log_dir / "redeployed-1.yaml", **{decode: {"num_replicas": 1}})
        took["decode 2 -> 1"] = redeploy(client.app, one)
        (kept,) = replica_ids(client.app, decode)
        took["decode 1 -> 2"] = redeploy(client.app, changed)
        assert kept in two and kept in replica_ids(client.app, decode), "a replica count change restarted a decode replica"
        served = traffic.count()
        _wait_for(lambda: traffic.count() >= served + 3, "requests after the last rollout")
    outcomes = traffic.outcomes
    summary = Counter((o.kind, "answered" if o.answered else "retryable" if o.retryable else "LOST") for o in outcomes)
    print(f"\nrollouts (s): { {k: round(v) for k, v in took.items()} }; requests: {dict(summary)}")
    lost = [o for o in outcomes if not (o.answered or o.retryable)]
    assert not lost, [(o.kind, o.status, o.error) for o in lost][:5]
    answered = [(o.prompt_ids, o.token_ids) for o in outcomes if o.answered]
    assert len(answered) >= 10, summary
    gaps = reference.teacher_forcing_gaps(answered)
    assert all(max(g) <= 1.0 for g in gaps), f"tokens more than 1 nat below the reference argmax: {gaps}"
    after = wait_ours(client, lambda c: c["conversation_turns", "replica_gone"] > before["conversation_turns", "replica_gone"])
    assert after["conversation_turns", "replica_gone"] > before["conversation_turns", "replica_gone"], after


def _wait_for(predicate, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
        time.sleep(1)
