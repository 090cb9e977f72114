"""A head, a prefill and a decode Ray node on this machine, each in its own network namespace with
its own address (``python -m app.cluster up``, what ``make serve-cluster`` runs): push answers are
token-identical to one engine, each engine advertises its own node's address as its NIXL side
channel, and the KV really crosses from the prefill node's interface into the decode node's. Ctrl-C
of the command must leave nothing behind: no namespace, veth, bridge, process or port."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from app.cluster import load_plan, present, teardown
from app.cluster_plan import NodeKind
from app.procs import AppProcess, busy_ports
from bench.engine_metrics import RoleMetrics, delta
from tests.integration.cases import CASE_BY_NAME, assert_token_identical, kv_bytes_per_token

CONFIG = "configs/local-cpu-2node.yaml"
HTTP_PORT = 8000  # the config's http_options.port

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2: the nodes live in network namespaces"
)


@pytest.fixture(scope="module")
def cluster(log_dir):
    plan = load_plan()
    assert present(plan) == ([], []), f"{present(plan)} left from an earlier run: python -m app.cluster down"
    app = AppProcess(CONFIG, log_dir, base_url=plan.base_url(HTTP_PORT))
    app.command = [sys.executable, "-m", "app.cluster", "up", CONFIG]  # as `make serve-cluster` runs it
    app.start()
    try:
        app.wait_ready(timeout_s=900)
        yield SimpleNamespace(plan=plan, app=app, http=httpx.Client(base_url=app.base_url, timeout=300))
    finally:
        try:
            code = app.interrupt(timeout_s=300)
        finally:
            left = present(plan)
            if left != ([], []):
                teardown(plan, app.run_id)  # leave the machine clean, then fail below
        assert left == ([], []), f"left behind: {left}\n{app.log_tail()}"
        assert not app.leftovers(), f"processes survived Ctrl-C: {app.leftovers()}\n{app.log_tail()}"
        assert not busy_ports(), f"ports {busy_ports()} bound on this host after the cluster went"
        assert code in (0, -2, 2, 130), f"exit code {code} after Ctrl-C\n{app.log_tail()}"


def link_bytes(link: str) -> tuple[int, int]:
    """(rx, tx) bytes of a root-namespace link: the host end of a node's veth pair, so its tx is
    what entered the node's namespace and its rx what left it."""
    stats = Path("/sys/class/net") / link / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def advertised(node, what: str) -> bool:
    """Whether the node's Serve logs say an engine set its side channel to the node's address."""
    line = f"NIXL {what} engine {what}-r0-{node.ip}-"
    return any(line in p.read_text(errors="replace") for p in Path(node.temp_dir).glob("session_latest/logs/serve/*.log"))


def test_push_across_nodes_is_token_identical_and_the_kv_crosses_the_decode_nodes_interface(cluster, reference):
    plan = cluster.plan
    prefill, decode = plan.node(NodeKind.PREFILL), plan.node(NodeKind.DECODE)
    assert advertised(prefill, "prefill") and advertised(decode, "decode")
    client = SimpleNamespace(post=cluster.http.post)
    assert_token_identical(client, reference, CASE_BY_NAME["chat-short"])

    case = CASE_BY_NAME["completion-long"]
    case.reference(reference)  # computed before the measured request: the reference engine shares the box
    metrics = RoleMetrics([plan.metrics_url(NodeKind.PREFILL), plan.metrics_url(NodeKind.DECODE)])
    before_metrics = metrics.settled_snapshot()
    before = {n.kind: link_bytes(n.host_link) for n in (prefill, decode)}
    got = assert_token_identical(client, reference, case)
    after = {n.kind: link_bytes(n.host_link) for n in (prefill, decode)}
    out_of_prefill = after[NodeKind.PREFILL][0] - before[NodeKind.PREFILL][0]
    into_decode = after[NodeKind.DECODE][1] - before[NodeKind.DECODE][1]
    # The prompt's KV but its last token's (decode computes that one), in whole blocks at most.
    kv = (len(got.prompt_ids) - 1) * kv_bytes_per_token(CONFIG)
    print(f"\n{len(got.prompt_ids)} prompt tokens, {kv} bytes of KV; out of the prefill node {out_of_prefill} bytes, "
          f"into the decode node {into_decode} bytes")
    assert into_decode >= kv and out_of_prefill >= kv, "the KV did not cross the nodes' interfaces"

    after_metrics = metrics.wait_for(lambda s: delta(s, before_metrics, "prefill", "nixl_xfer_time_seconds_count") >= 1)
    assert delta(after_metrics, before_metrics, "prefill", "nixl_xfer_time_seconds_count") == 1, "one NIXL WRITE"
