"""Faults on the push app (tests/integration/push): clients that hang up, a stalled and a killed prefill
engine, fuzzed bodies and sustained overload. Every request ends with a correct answer or a clean error."""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx
import pytest

from app.tools.procs import BASE_URL, engine_processes
from bench.faults import healthy_replicas, wait_replaced
from bench.openloop import body_for

from tests.integration.cases import (
    CASE_BY_NAME,
    Case,
    assert_kv_travelled,
    assert_token_identical,
    long_text,
    parse_generation,
    parse_stream_generation,
    read_stream,
    requests_by_prefill_path,
)
from tests.integration.apps import EngineGauges
from bench.reference import app_args
from tests.integration.push import CHAT, COMPLETIONS, CONFIG


@pytest.mark.slow
def test_client_disconnects_mid_stream_abort_both_legs_and_free_their_kv(client, reference):
    def first_chunk_then_hang_up(i: int) -> bool:
        # Long enough that none could finish on its own within the test's wait.
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with client.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            return any(line.startswith("data: ") for line in r.iter_lines())  # stops at the first event

    with EngineGauges(client, ("prefill", "decode")) as gauges:
        with cf.ThreadPoolExecutor(32) as pool:
            assert all(pool.map(first_chunk_then_hang_up, range(32)))
        # Prefill keeps pushed blocks until decode acknowledges the WRITE (or a 30 s lease).
        gauges.wait_idle(timeout_s=60)
    assert_token_identical(client, reference, CASE_BY_NAME["chat-short"])


@pytest.mark.slow
def test_a_stalled_prefill_engine_falls_back_to_local_prefill_and_frees_decode_kv(client, reference):
    """SIGSTOP the prefill engine: requests are served by decode's own prefill once the
    prefill leg misses its deadline, correctly; the late WRITEs (or the KV deadline) give
    decode's blocks back; then disaggregation resumes."""
    handoff = app_args(CONFIG).handoff
    chat, completion = CASE_BY_NAME["chat-short"], CASE_BY_NAME["completion-short"]
    expected_chat, expected_stream = chat.reference(reference), completion.reference(reference)
    before = requests_by_prefill_path(client)
    engines = engine_processes("Prefill")
    assert engines, "no prefill engine process found"

    def chat_answer():
        r = client.post(chat.endpoint, json=chat.body())
        assert r.status_code == 200, r.text
        return parse_generation(chat, r.json()).token_ids

    def streamed_answer():
        with client.http.stream("POST", completion.endpoint, json=completion.body(stream=True)) as r:
            assert r.status_code == 200, r.read()
            return read_stream(r)

    # Watched from the start: an engine that has not stepped for a few seconds reports nothing at all.
    with EngineGauges(client, ("prefill", "decode")) as gauges:
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with cf.ThreadPoolExecutor(2) as pool:
                answers = pool.submit(chat_answer), pool.submit(streamed_answer)
                assert answers[0].result() == expected_chat.token_ids
                assert answers[1].result() == expected_stream.text
            elapsed = time.monotonic() - started
        finally:
            for pid in engines:
                os.kill(pid, signal.SIGCONT)
            gauges.resumed("prefill")
        gauges.wait_idle(timeout_s=handoff.kv_timeout_s + 30)
    assert handoff.prefill_timeout_s <= elapsed < handoff.prefill_timeout_s + 60, f"answered after {elapsed:.0f} s"
    deadline = time.monotonic() + 30
    while (grown := requests_by_prefill_path(client) - before)["fallback"] < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert grown["fallback"] == 2, f"requests by prefill path: {dict(grown)}"
    assert_kv_travelled(client, reference, CONFIG, writer="prefill")


@pytest.mark.slow
def test_a_killed_prefill_engine_loses_no_request_and_its_replica_recovers(client, reference):
    """SIGKILL the prefill engine while requests are in flight: every request is answered
    correctly (decode prefills what prefill could not) or fails with a clean error, none
    hangs; Serve replaces the prefill replica and requests are disaggregated again."""
    replicas = healthy_replicas(client.metrics.url, "Prefill")
    assert len(replicas) == 1, replicas
    cases = [CASE_BY_NAME[name] for name in ("chat-long", "completion-long", "chat-short", "completion-short")] * 2
    expected = [case.reference(reference) for case in cases]
    before = requests_by_prefill_path(client)

    def answer(case):
        r = client.post(case.endpoint, json=case.body(), timeout=180)
        return r.status_code, r.json()

    engines = engine_processes("Prefill")
    assert engines, "no prefill engine process found"
    not_ready = []  # /ready stays 200 throughout: decode prefills locally while prefill is replaced
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(answer, case) for case in cases]
        time.sleep(0.5)  # in flight: the long prompts are still being prefilled
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        while not all(f.done() for f in futures):
            if (ready := client.http.get("/ready")).status_code != 200:
                not_ready.append(ready.json())
            time.sleep(1)
        results = [f.result() for f in futures]
    for case, want, (status, body) in zip(cases, expected, results):
        if status == 200:
            assert parse_generation(case, body).token_ids == want.token_ids, case.name
        else:  # a clean error: OpenAI-shaped, a server error or admission's 429, no stack trace
            # (admission learned from the stalled-prefill test before that first bytes can take 30 s here)
            assert status in (429, 500, 502, 503) and set(body) == {"error"} and "Traceback" not in json.dumps(body), (
                status, body)

    wait_replaced(client.metrics.url, "Prefill", gone=set(replicas), count=1)
    assert not_ready == [], f"/ready said 503 while decode could prefill locally: {not_ready}"
    assert_kv_travelled(client, reference, CONFIG, writer="prefill")
    grown = requests_by_prefill_path(client) - before
    assert grown["fallback"] >= 1, f"requests by prefill path: {dict(grown)}"


# Fuzzed and overload traffic: after the load step, whose transfer counts need a quiet app
# (overload's fallbacks count failed transfers that Ray exports seconds later).
FUZZ_EXAMPLES = 120  # fixed and derandomized: the same bodies on every run


def _send_hostile(client, path: str, body) -> tuple[int, str]:
    """Status and text of one request; a stream is read to its end (it must end)."""
    payload = json.dumps(body)  # NaN and Infinity included: not JSON, a client error
    headers = {"content-type": "application/json"}
    if isinstance(body, dict) and body.get("stream") is True:
        with client.http.stream("POST", path, content=payload, headers=headers, timeout=120) as r:
            return r.status_code, "".join(r.iter_text())
    r = client.http.post(path, content=payload, headers=headers, timeout=120)
    return r.status_code, r.text


@pytest.mark.slow
def test_fuzzed_requests_never_get_a_5xx_and_the_server_keeps_serving(client, reference):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.integration import fuzz

    bodies = st.one_of(
        st.tuples(st.just(CHAT), fuzz.VALID_CHAT),
        st.tuples(st.just(COMPLETIONS), fuzz.VALID_COMPLETION),
        st.tuples(st.just(CHAT), fuzz.CHAT),
        st.tuples(st.just(COMPLETIONS), fuzz.COMPLETION),
        st.tuples(st.sampled_from([CHAT, COMPLETIONS]), fuzz.NOT_AN_OBJECT),
    )
    seen = Counter()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def no_5xx(case):
        path, body = case
        status, text = _send_hostile(client, path, body)
        seen[status // 100] += 1
        assert status < 500, f"{status} for {path} {json.dumps(body)[:500]}: {text[:500]}"
        assert "Traceback" not in text

    no_5xx()
    assert seen[2] and seen[4], f"responses by class: {dict(seen)} (the bodies should get both answers and 4xx)"
    assert client.http.get("/health").status_code == 200
    assert_token_identical(client, reference, CASE_BY_NAME["chat-short"])
    # A prefill leg whose KV no decode takes (a body decode refused) would hold it until its lease runs out: the
    # client fixture reads the log for such releases once this lease has run out.
    lease_s = app_args(CONFIG).nixl.extra_config.get("kv_lease_duration", 30)  # vLLM's default
    client.expiries_logged_by = time.monotonic() + lease_s + 5


OVERLOAD_S, OVERLOAD_FACTOR = 60, 4


@pytest.mark.slow
def test_sustained_overload_is_shed_quickly_and_every_admitted_answer_is_correct(client, reference, tmp_path):
    """Four times the rate the box sustains, for a minute (open loop, Poisson arrivals,
    from a process of its own: bench.openloop), streamed. Each request either completes
    correctly (teacher-forced: vLLM is not batch-invariant), or gets a 429 with Retry-After and
    an OpenAI error body quickly (admission: app/routing/admission.py), or a 503 with Retry-After at
    the queue deadline; none that was admitted starts later than that deadline. Then no engine
    holds a request or a KV block, and the app serves as before."""
    ingress = app_args(CONFIG).ingress
    prompt = long_text(3) + "\nNote {i} says"
    whole = Case("load", prompt=prompt).body(max_tokens=16)
    streamed = {**Case("load", prompt=prompt).body(stream=True, max_tokens=16), "return_token_ids": True}

    # What the box sustains: completions per second with max_in_flight requests always offered.
    limit, calibration_s, answered, ids = ingress.max_in_flight, 20.0, 0, itertools.count()
    with httpx.Client(base_url=BASE_URL, timeout=300, limits=httpx.Limits(max_connections=limit)) as http:
        send = lambda i: http.post("/v1/completions", json=body_for(whole, i))  # noqa: E731
        with cf.ThreadPoolExecutor(limit) as pool:
            started = time.monotonic()
            pending = {pool.submit(send, next(ids)) for _ in range(limit)}
            while pending:
                done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                answered += sum(f.result().status_code == 200 for f in done)
                if time.monotonic() - started < calibration_s:
                    pending |= {pool.submit(send, next(ids)) for _ in done}
            sustained = answered / (time.monotonic() - started)

    assert sustained > 0, "nothing was answered while calibrating"
    rate, out = OVERLOAD_FACTOR * sustained, tmp_path / "overload.jsonl"
    # Watched from the start: an idle engine stops reporting its gauges a few seconds later.
    with EngineGauges(client, ("prefill", "decode")) as gauges:
        held_before = gauges.kv_held_now()  # an earlier test's held blocks are its own (EngineGauges.kv_held_now)
        subprocess.run(
            [sys.executable, "-m", "bench.openloop", "--base-url", BASE_URL, "--path", "/v1/completions",
             "--body", json.dumps(streamed), "--rate", f"{rate:.3f}", "--seconds", str(OVERLOAD_S), "--seed", "7",
             "--first-index", str(next(ids)), "--out", str(out)],
            check=True, timeout=OVERLOAD_S + 600,
        )
        # Nothing admitted, expired or hung up on is left running or holding KV.
        gauges.wait_idle(timeout_s=90, kv_held_before=held_before)
    results = [json.loads(line) for line in out.read_text().splitlines()]

    statuses = Counter(r["status"] for r in results)
    assert set(statuses) <= {200, 429, 503}, [str(r["response"])[:200] for r in results if r["status"] not in (200, 429, 503)]
    accepted = [r for r in results if r["status"] == 200]
    # A rejection's time, less the longest stall of the client's own loop meanwhile (bench.openloop:
    # on 2 cores the client is starved at times; an answer it reads late is not a slow server).
    rejected = sorted(max(0.0, r["latency_s"] - r["client_stall_s"]) for r in results if r["status"] == 429)
    assert accepted and rejected, statuses
    for r in results:
        if r["status"] == 429:
            assert int(r["retry_after"]) > 0 and r["response"]["error"]["type"] == "rate_limit_error", r
        if r["status"] == 503:
            assert int(r["retry_after"]) > 0 and "queue deadline" in r["response"]["error"]["message"], r
    # Admitted and started within the queue deadline, or answered 503 at it. The deadline is the setting's wait plus
    # the request's own expected prefill, (deadline_margin + 1) times its cost (app/request/deadlines.py): for these ~45-token
    # prompts under a second on this box, 2 s allowed; and 1 s for the client's own reading.
    late = [(r["index"], r["first_byte_s"]) for r in accepted if r["first_byte_s"] > ingress.queue_deadline_s + 2 + 1]
    assert not late, f"admitted streams whose first event came after the queue deadline: {late}"
    generations = [parse_stream_generation(r["response"]) for r in accepted]
    all_gaps = reference.teacher_forcing_gaps([(g.prompt_ids, g.token_ids) for g in generations])
    bad = [(r["index"], max(gaps)) for r, gaps in zip(accepted, all_gaps) if max(gaps) > 1.0]
    assert not bad, f"tokens more than 1 nat below the reference argmax: {bad}"

    p99 = rejected[min(len(rejected) - 1, int(0.99 * len(rejected)))]
    stalls = [r["client_stall_s"] for r in results]
    answer_s = sorted(r["latency_s"] for r in accepted)
    first_s = sorted(r["first_byte_s"] for r in accepted)
    print(f"overload: {sustained:.2f} req/s sustained, {rate:.2f} req/s offered for {OVERLOAD_S} s: "
          f"{len(accepted)} answered (first event median {first_s[len(first_s) // 2]:.1f} s, p99 "
          f"{first_s[min(len(first_s) - 1, int(0.99 * len(first_s)))]:.1f} s; answer median "
          f"{answer_s[len(answer_s) // 2]:.1f} s), {len(rejected)} rejected (p99 {p99:.2f} s, max {rejected[-1]:.2f} s), "
          f"{statuses[503]} given up at the queue deadline; the client's loop stalled {max(stalls):.2f} s at the longest")
    # The target is a p99 under 1 s (docs/operations.md, "Admission"): a benchmark figure, not asserted (a slower
    # box is not a defect). What must hold anywhere: a rejection does not wait behind the work it was
    # refused for. p95, not p99: one stall of a 2-core box (seen once in CI: 18 rejections read together
    # 4.4 s late) moves a p99 of ~2,000 but not a p95; none may take as long as a typical answer.
    p95, median_answer = rejected[int(0.95 * len(rejected))], answer_s[len(answer_s) // 2]
    slowest = sorted((r for r in results if r["status"] == 429), key=lambda r: r["latency_s"] - r["client_stall_s"])[-5:]
    assert p95 < median_answer / 4 and rejected[-1] < median_answer, (
        f"rejections: p95 {p95:.2f} s, max {rejected[-1]:.2f} s; the slowest (sent at s, took s, client stalled s): "
        f"{[(round(r['sent_s'], 2), round(r['latency_s'], 2), round(r['client_stall_s'], 2)) for r in slowest]}")
    assert_token_identical(client, reference, CASE_BY_NAME["chat-short"])
