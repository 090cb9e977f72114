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


def settled_served(client, deployment: str, quiet_s: float = 12.0) -> Counter:
    """Serve's counters once they stopped changing: a fresh scrape can still lack the
    last requests (Ray exports metrics every few seconds)."""
    counts, since = served_by_replica(client, deployment), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(2)
        current = served_by_replica(client, deployment)
        if current != counts:
            counts, since = current, time.monotonic()
    return counts


def wait_served(client, deployment: str, before: Counter, total: int, timeout_s: float = 90) -> Counter:
    deadline = time.monotonic() + timeout_s
    while True:
        grown = served_by_replica(client, deployment) - before
        if sum(grown.values()) >= total or time.monotonic() > deadline:
            return grown
        time.sleep(1)


def test_requests_reach_both_decode_replicas_and_stay_identical(client, reference):
    before = settled_served(client, "Decode")
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
    before = settled_served(client, "Decode")
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
    worker.join(timeout=900)
    assert long_done.is_set(), "the long generation failed"
    # Serve's counters are exported every few seconds: wait until all 7 requests show.
    grown = wait_served(client, "Decode", before, len(shorts) + 1)
    assert sorted(grown.values()) == [1, len(shorts)], (
        f"requests per decode replica {dict(grown)}: the busy one should have served only its long generation"
    )


def test_short_prompts_are_prefilled_locally_long_ones_remotely(client, reference):
    """local_prefill_below_tokens: 16 in the config."""
    metrics = client.metrics
    prefill_before = settled_served(client, "Prefill")
    short = CASE_BY_NAME["completion-short"]  # 5 tokens
    for _ in range(3):
        assert_token_identical(client, reference, short)
    time.sleep(8)  # past Ray's metrics export period: a remote prefill would show by now
    assert sum((served_by_replica(client, "Prefill") - prefill_before).values()) == 0, "short prompts reached prefill"

    before = metrics.settled_snapshot()
    assert_token_identical(client, reference, CASE_BY_NAME["completion-long"])
    after = metrics.wait_for(lambda s: delta(s, before, "prefill", "nixl_xfer_time_seconds_count") >= 1)
    assert delta(after, before, "prefill", "nixl_xfer_time_seconds_count") == 1
