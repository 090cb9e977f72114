"""The push app's answers and its API (tests/integration/push: one app for the package): token-identical
greedy and streamed answers, the longest prompt allowed at full and half CPU, each request's stage timeline,
what decode serves alone, usage, the stock OpenAI client, /health and /ready, a second start refused,
32 concurrent requests, KV checksums on pushed KV, bad input, and the benchmark's load step."""

from __future__ import annotations

import concurrent.futures as cf
import csv
import itertools
import json
import math
import random
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import openai
import pytest

from app.model_source import resolve_model_source
from app.tools.procs import BASE_URL, MARKER, REPO, cpu_seconds, engine_processes, find_processes, new_run_env
from bench.engine_metrics import samples_named
from bench.plots import plot_results
from bench.profiles import app_args_of, load_config
from bench.results import COLUMNS, write_results
from bench.sweep import run_point

from tests.integration.cases import (
    CASE_BY_NAME,
    logged_timelines,
    new_timelines,
    CASES,
    STREAMED,
    Case,
    assert_answers_as_vllms_server,
    assert_decode_serves_alone_what_a_prefill_leg_cannot,
    assert_misrouted_kv_is_refused,
    assert_stream_identical,
    assert_token_identical,
    assert_wrong_kv_is_caught,
    long_text,
    longest_prompt,
    parse_generation,
    read_stream,
    requests_by_prefill_path,
)
from tests.integration.cpu_quota import cpu_quota
from bench.reference import app_args
from tests.integration.push import CHAT, COMPLETIONS, CONFIG, MODEL


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
    paths_before = requests_by_prefill_path(client)

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
    while sum((grown := requests_by_prefill_path(client) - paths_before).values()) < 10 and time.monotonic() < deadline:
        time.sleep(1)
    assert dict(grown) == {"remote": 10}, f"not every request was pushed; by prefill path: {dict(grown)}"
    assert decode_cpu < 0.35 * waited, f"decode used {decode_cpu:.2f} CPU s in {waited:.1f} s (prefill {prefill_cpu:.2f})"


def test_every_stage_of_a_request_is_timed_in_order(client):
    """app.request.timeline: each request's stamps in the order it passes them (one host, one
    clock), one log line per request, and the stage histogram on a live scrape. A whole answer's first token is its
    engine's, before the answer (app.decode.first_token)."""
    seen = len(logged_timelines(client))
    for stream in (False, True):
        r = client.post("/v1/completions", json={**CASE_BY_NAME["completion-long"].body(max_tokens=4), "stream": stream})
        assert r.status_code == 200
    order = ["arrived", "decode_picked", "decode_received", "legs_sent", "prefill_queued", "prefill_started",
             "prefill_finished", "kv_landed", "first_scheduled", "engine_output", "first_token", "first_chunk"]
    for timeline in new_timelines(client, seen, count=2)[-2:]:
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
        stages = {labels["stage"]: value for labels, value in samples_named(client.metrics.url, "ray_rendezvous_stage_seconds_count")
                  if labels.get("mode") == "push"}
        time.sleep(1)
    assert {"route", "decode_pick", "decode_hop", "bind", "prefill_pick", "prefill_hop", "prefill_queue", "prefill_compute",
            "register", "handoff", "transfer", "write_wait", "write", "first_step", "schedule", "forward", "output",
            "deliver", "ttft"} <= set(stages)
    sums = {labels["stage"]: value for labels, value in samples_named(client.metrics.url, "ray_rendezvous_stage_seconds_sum")
            if labels.get("mode") == "push"}
    assert all(v >= 0 for v in sums.values()) and sums["ttft"] >= sums["handoff"]


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
    then 200, and nothing else; from the proxy's first answer on, every poll was answered (before the ingress
    replica ran, by the proxy: app.ingress.proxy_gate); `make serve` said so in one line, after both engines
    warmed up."""
    assert client.app.readiness_seen == [503, 200], client.app.readiness_seen
    assert client.app.readiness_unanswered == [], "seconds into the start at which /ready hung or was not ours"
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


def test_a_prefill_leg_of_other_tokens_is_never_written_into_decode(client, reference):
    """connector.kv_identity: prefill's writer compares the registration's prompt digest with its leg's."""
    assert_misrouted_kv_is_refused(client, reference)


def test_every_request_shape_is_answered_as_vllms_own_server_answers_it(client, vllm_server):
    """bench.parity, on this app: three shapes as a conversation's first turn (its KV kept for a next turn). Prompt
    lists among them, answered prompt by prompt (app.ingress.prompt_list)."""
    assert_answers_as_vllms_server(client, vllm_server, conversational={"completion", "chat", "stream-usage"})


# Bad input gets an OpenAI-style 4xx JSON error, and the server keeps serving.
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
