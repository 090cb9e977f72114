"""1 prefill : 2 decode on one box (configs/local-cpu-1p2d.yaml): per-replica ports and
engine ids never clash, and both decode replicas serve token-identical answers."""

from __future__ import annotations

import pytest

from tests.integration.cases import CASE_BY_NAME, CASES, assert_token_identical
from tests.integration.conftest import app_client
from tests.integration.metrics import delta

CONFIG = "configs/local-cpu-1p2d.yaml"


@pytest.fixture(scope="module")
def client(log_dir):
    yield from app_client(CONFIG, log_dir)


def test_requests_reach_both_decode_replicas_and_stay_identical(client, reference):
    before = client.metrics.settled_snapshot()
    cases = [CASE_BY_NAME["completion-short"], CASE_BY_NAME["chat-short"], CASE_BY_NAME["chat-system"]] * 5
    for case in cases:
        assert_token_identical(client, reference, case)

    after = client.metrics.wait_for(lambda snap: len(_used_decode(snap, before)) == 2, timeout_s=60)
    used = _used_decode(after, before)
    assert len(used) == 2, f"only decode replicas {used} served requests"


@pytest.mark.parametrize("case", [c for c in CASES if "long" in c.name], ids=lambda c: c.name)
def test_long_prompts_are_token_identical(client, reference, case):
    assert_token_identical(client, reference, case)


def _decode_replicas(snap) -> set[str]:
    # Only decode engines take prompt tokens from an external (NIXL) source in push mode.
    return {key for key, values in snap.items() if key.startswith("replica:") and values.get("external_prefix_cache_hits_total", 0) > 0}


def _used_decode(after, before) -> set[str]:
    return {key for key in _decode_replicas(after) if delta(after, before, key, "request_success_total") > 0}
