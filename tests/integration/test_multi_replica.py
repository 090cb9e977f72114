"""1 prefill : 2 decode on one box (configs/local-cpu-1p2d.yaml): per-replica ports and
engine ids never clash, both decode replicas serve token-identical answers, the decode
pick is load-aware, and short prompts are prefilled locally (no transfer)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from bench.engine_metrics import delta, scrape
from tests.integration.cases import CASE_BY_NAME, CASES, assert_token_identical
from tests.integration.conftest import app_client

CONFIG = "configs/local-cpu-1p2d.yaml"


@pytest.fixture(scope="module")
def client(log_dir):
    yield from app_client(CONFIG, log_dir)


def served_by_replica(client, deployment: str) -> Counter:
    """Requests each replica of ``deployment`` completed (Serve's own exact counter)."""
    counts = Counter()
    for name, labels, value in scrape(client.metrics.url):
        if name == "ray_serve_deployment_request_counter_total" and labels.get("deployment", "").startswith(deployment):
            counts[labels["replica"]] += value
    return counts


def wait_served(client, deployment: str, before: Counter, total: int, timeout_s: float = 90) -> Counter:
    deadline = time.monotonic() + timeout_s
    while True:
        grown = served_by_replica(client, deployment) - before
        if sum(grown.values()) >= total or time.monotonic() > deadline:
            return grown
        time.sleep(1)


def test_requests_reach_both_decode_replicas_and_stay_identical(client, reference):
    before = served_by_replica(client, "Decode")
    cases = [CASE_BY_NAME["chat-short"], CASE_BY_NAME["chat-system"], CASE_BY_NAME["completion-short"]] * 4
    for case in cases:
        assert_token_identical(client, reference, case)
    grown = wait_served(client, "Decode", before, len(cases))
    assert sum(grown.values()) == len(cases)
    assert len(grown) == 2, f"only decode replicas {dict(grown)} served requests"


@pytest.mark.parametrize("case", [c for c in CASES if "long" in c.name], ids=lambda c: c.name)
def test_long_prompts_are_token_identical(client, reference, case):
    assert_token_identical(client, reference, case)


def test_new_requests_avoid_the_decode_replica_busy_with_a_long_generation(client, reference):
    before = served_by_replica(client, "Decode")
    long_done = threading.Event()

    def long_generation():
        r = client.post("/v1/completions", json={
            "prompt": "Count from one to one thousand:", "max_tokens": 700, "ignore_eos": True, "temperature": 0,
        })
        assert r.status_code == 200, r.text
        long_done.set()

    worker = threading.Thread(target=long_generation)
    worker.start()
    time.sleep(4)  # the busy replica's published stats (every second) now show it
    shorts = [CASE_BY_NAME["chat-short"], CASE_BY_NAME["completion-short"], CASE_BY_NAME["chat-system"]] * 2
    for case in shorts:
        assert_token_identical(client, reference, case)
    assert not long_done.is_set(), "the long generation ended too early for this test to mean anything"
    grown = wait_served(client, "Decode", before, len(shorts))
    worker.join(timeout=600)
    assert len(grown) == 1 and sum(grown.values()) == len(shorts), (
        f"short requests went to {dict(grown)}; all should avoid the busy replica"
    )
    idle = next(iter(grown))
    busy = served_by_replica(client, "Decode") - before - grown
    assert idle not in busy


def test_short_prompts_are_prefilled_locally_long_ones_remotely(client, reference):
    """local_prefill_below_tokens: 16 in the config."""
    metrics = client.metrics
    prefill_before = served_by_replica(client, "Prefill")
    short = CASE_BY_NAME["completion-short"]  # 5 tokens
    for _ in range(3):
        assert_token_identical(client, reference, short)
    time.sleep(8)  # past Ray's metrics export period: a remote prefill would show by now
    assert sum((served_by_replica(client, "Prefill") - prefill_before).values()) == 0, "short prompts reached prefill"

    before = metrics.settled_snapshot()
    assert_token_identical(client, reference, CASE_BY_NAME["completion-long"])
    after = metrics.wait_for(lambda s: delta(s, before, "prefill", "nixl_xfer_time_seconds_count") >= 1)
    assert delta(after, before, "prefill", "nixl_xfer_time_seconds_count") == 1
