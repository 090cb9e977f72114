"""Pull, and GCS fault tolerance, on the three-node cluster of this machine (tests/integration/cluster.py) with a
Redis of its own (``app.tools.cluster up --gcs-ft``), its worker nodes' links shaped to a set rate.

- Decode READs the prompt's KV from the prefill node across the nodes' interfaces and through the shaped link, in
  one transfer, and answers are token-identical to one engine.
- The head's GCS process killed under a trickle of requests, then started again: no request fails meanwhile, the
  GCS reloads the cluster's state from Redis, and Serve places a new replica afterwards.
- The whole head node killed and started again with the same Redis (``app.tools.drill``): the engines keep their
  processes (no model load), Serve's controller takes its replicas back, and the app answers token-identically.

The node-loss paths are the handoff's, shared by both modes, and test_cluster.py runs them in push (unshaped),
with a conversation's history crossing back; tensor-parallel combinations run on one node
(test_tensor_parallel.py): across these nodes, pull into decode TP 3 hung its READ in two of three attempts
(docs/cluster.md, "Several ranks")."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from app.tools.cluster import namespace_pids
from app.tools.cluster_plan import NodeKind
from app.tools.drill import all_replicas_healthy, run_drill
from app.tools.procs import process_name, running
from tests.integration.apps import with_args
from tests.integration.cases import CASE_BY_NAME, assert_token_identical
from tests.integration.cluster import CONFIG, FT_CONFIG, assert_kv_crosses_the_nodes, needs_root, running_cluster

pytestmark = needs_root


# The worker nodes' links shaped (app.tools.cluster --link-mbit, Linux tbf): KV crosses a link of a set rate, as
# between machines; the rate at which a transfer is ~20 % of its prefill on this box (docs/cluster.md, "A shaped link").
LINK_MBIT = 800
DOWN_S = 10  # how long the GCS, or the head, stays away
SERVING_AGAIN_S = 60  # the target: Serve's controller has every replica back within this of the head's return


@pytest.fixture(scope="module")
def cluster(log_dir):
    yield from running_cluster(with_args(FT_CONFIG, log_dir, name="local-cpu-2node-ft-pull", mode="pull"), log_dir,
                               link_mbit=LINK_MBIT, gcs_ft=True)


def test_pull_across_nodes_is_token_identical_and_the_kv_crosses_the_nodes_shaped_links(cluster, reference):
    assert_kv_crosses_the_nodes(cluster, reference, CONFIG, writer="decode")


def test_the_gcs_killed_under_traffic_fails_no_request_and_a_new_replica_is_placed_after(cluster, reference):
    report = run_drill(cluster.plan, "gcs", down_s=DOWN_S, after_s=10)
    print(f"\nGCS drill: {asdict(report)}")
    assert report.answered >= DOWN_S and report.failed == 0 and report.wrong == 0, asdict(report)
    assert not report.engines_restarted and report.controller_back_s is not None, asdict(report)

    # Placing a replica needs the GCS (a new actor): SIGKILL the ingress replica and wait for Serve's new one.
    ingress = _ingress_pids(cluster.plan)
    assert len(ingress) == 1, ingress
    os.kill(ingress.pop(), signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (all_replicas_healthy(cluster.plan) and _ingress_pids(cluster.plan)):
        assert time.monotonic() < deadline, "Serve placed no new ingress replica within 120 s after the GCS returned"
        time.sleep(2)
    cluster.app.wait_ready(timeout_s=120)
    assert_token_identical(cluster, reference, CASE_BY_NAME["chat-short"])


def test_the_head_restarted_keeps_the_engines_and_serves_on(cluster, reference):
    report = run_drill(cluster.plan, "head", down_s=DOWN_S, after_s=10)
    print(f"\nhead drill: {asdict(report)}")
    assert not report.engines_restarted, "an engine process was replaced: its model loaded again"
    assert report.wrong == 0 and report.answered >= DOWN_S, asdict(report)
    assert report.failed == 0, f"requests failed while the head was away: {asdict(report)}"
    assert report.controller_back_s is not None and report.controller_back_s <= SERVING_AGAIN_S, asdict(report)
    # The controller took its replicas back: a long prompt's KV still crosses, and the answer is identical.
    assert_kv_crosses_the_nodes(cluster, reference, CONFIG, writer="decode")


def _ingress_pids(plan) -> set[int]:
    """The ingress replica's process on the decode node (configs/local-cpu-2node-ft.yaml puts it there)."""
    pids = running(namespace_pids([plan.node(NodeKind.DECODE).namespace]))
    return {pid for pid in pids if process_name(pid) == "ray::ServeRepli" and "OpenAiIngress" in _cmdline(pid)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
