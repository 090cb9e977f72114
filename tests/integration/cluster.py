"""A head, a prefill and a decode Ray node on this machine (``python -m app.tools.cluster up``, what
``make serve-cluster`` runs), shared by the cluster test modules: start one, talk to it, and
check that Ctrl-C of the command leaves nothing behind (no namespace, veth, bridge, process or
port)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from app.tools.cluster import link_mbit as shaped_rate, load_plan, present, shaped_out, teardown
from app.tools.cluster_plan import NodeKind
from app.tools.procs import AppProcess, busy_ports
from bench.engine_metrics import RoleMetrics
from bench.profiles import kv_bytes_per_token
from tests.integration.cases import CASE_BY_NAME, assert_kv_travelled, assert_token_identical

CONFIG = "configs/local-cpu-2node.yaml"
FT_CONFIG = "configs/local-cpu-2node-ft.yaml"  # up --gcs-ft
HTTP_PORT = 8000  # the config's http_options.port

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2: the nodes live in network namespaces"
)


def running_cluster(config: str, log_dir: Path, link_mbit: float | None = None, gcs_ft: bool = False):
    """Serve ``config`` on a fresh cluster (its worker nodes' links shaped to ``link_mbit``, if given; with GCS
    fault tolerance on a Redis of its own, ``gcs_ft``); yields a client: ``post`` and ``http`` to the proxy
    clients use (the head's, or with ``gcs_ft`` the decode node's), ``metrics`` over the decode and prefill nodes
    (decode first: the conversation counters live there), ``plan`` and ``app``."""
    plan = load_plan(link_mbit=link_mbit, gcs_ft=gcs_ft)
    assert present(plan) == ([], []), f"{present(plan)} left from an earlier run: python -m app.tools.cluster down"
    args = ([] if link_mbit is None else ["--link-mbit", f"{link_mbit:g}"]) + (["--gcs-ft"] if gcs_ft else [])
    app = AppProcess(config, log_dir, how="cluster", base_url=plan.base_url(HTTP_PORT), args=args)
    app.start()
    try:
        app.wait_ready(timeout_s=900)
        for kind in (NodeKind.PREFILL, NodeKind.DECODE):  # not in /tmp, where a killed engine leaves them
            assert any(Path(plan.node(kind).rpc_dir).iterdir()), f"no vLLM IPC socket in {plan.node(kind).rpc_dir}"
        http = httpx.Client(base_url=app.base_url, timeout=300)
        yield SimpleNamespace(
            plan=plan, app=app, http=http, post=http.post,
            metrics=RoleMetrics([plan.metrics_url(NodeKind.DECODE), plan.metrics_url(NodeKind.PREFILL)]),
        )
    finally:
        try:
            code = app.interrupt(timeout_s=300)
        finally:
            left = present(plan)
            if left != ([], []):
                teardown(plan, app.run_id)  # leave the machine clean, then fail below
        assert left == ([], []), f"left behind: {left}\n{app.log_tail()}"
        assert not [n.rpc_dir for n in plan.nodes if Path(n.rpc_dir).exists()], "the nodes' IPC socket directories outlived them"
        assert not (plan.redis and Path(plan.redis.data_dir).exists()), "Redis's directory (and password) outlived it"
        false_alarms = [line[-200:] for line in app.log_path.open(errors="replace") if "landed wrong" in line]
        assert not false_alarms, f"KV checksums failed on clean traffic: {false_alarms}"
        assert not app.leftovers(), f"processes survived Ctrl-C: {app.leftovers()}\n{app.log_tail()}"
        assert not busy_ports(), f"ports {busy_ports()} bound on this host after the cluster went"
        assert code in (0, -2, 2, 130), f"exit code {code} after Ctrl-C\n{app.log_tail()}"


def link_bytes(link: str) -> tuple[int, int]:
    """(rx, tx) bytes of a root-namespace link: the host end of a node's veth pair, so its tx is
    what entered the node's namespace and its rx what left it."""
    stats = Path("/sys/class/net") / link / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def advertised(node, what: str, replicas: set[str] | None = None) -> bool:
    """Whether the node's Serve logs say an engine set its side channel to the node's address
    (only the logs of ``replicas``, Serve's replica ids, if given: a node that rejoined keeps its
    Ray session's logs)."""
    line = f"NIXL {what} engine {what}-r0-{node.ip}-"
    logs = Path(node.temp_dir).glob("session_latest/logs/serve/replica_*.log")
    if replicas is not None:
        logs = [p for p in logs if any(p.stem.endswith("_" + r.rsplit("#", 1)[-1]) for r in replicas)]
    return any(line in p.read_text(errors="replace") for p in logs)


def assert_kv_crosses_the_nodes(cluster, reference, config: str, writer: str, ranks: int = 1) -> None:
    """Token-identical answers across the nodes; each engine advertised its own node's address;
    a long prompt's KV left the prefill node's interface and entered the decode node's, in
    ``ranks`` NIXL transfers posted by ``writer`` (prefill WRITEs in push, decode READs in pull;
    cases.assert_kv_travelled)."""
    plan = cluster.plan
    prefill, decode = plan.node(NodeKind.PREFILL), plan.node(NodeKind.DECODE)
    assert advertised(prefill, "prefill") and advertised(decode, "decode")
    assert_token_identical(cluster, reference, CASE_BY_NAME["chat-short"])

    case = CASE_BY_NAME["completion-long"]
    prompt_tokens = len(case.reference(reference).prompt_ids)  # before measuring: the reference engine shares the box
    before = {n.kind: link_bytes(n.host_link) for n in (prefill, decode)}
    shaped_before = shaped_out(plan, NodeKind.PREFILL)
    assert_kv_travelled(cluster, reference, config, writer, ranks)
    after = {n.kind: link_bytes(n.host_link) for n in (prefill, decode)}
    shaped_bytes, held_back = (a - b for a, b in zip(shaped_out(plan, NodeKind.PREFILL), shaped_before))
    out_of_prefill = after[NodeKind.PREFILL][0] - before[NodeKind.PREFILL][0]
    into_decode = after[NodeKind.DECODE][1] - before[NodeKind.DECODE][1]
    # The prompt's KV but its last token's (decode computes that one), in whole blocks at most.
    kv = (prompt_tokens - 1) * kv_bytes_per_token(config)
    print(f"\n{prompt_tokens} prompt tokens, {kv} bytes of KV; out of the prefill node {out_of_prefill} bytes, "
          f"into the decode node {into_decode} bytes")
    assert into_decode >= kv and out_of_prefill >= kv, "the KV did not cross the nodes' interfaces"
    if plan.link is not None:  # app.tools.cluster --link-mbit: it crossed the shaped link, and the rate held it back
        rate = shaped_rate(plan)
        print(f"shaped to {rate:g} Mbit/s: {shaped_bytes} bytes through the prefill node's token bucket, "
              f"{held_back} times held back")
        assert rate == plan.link.mbit and shaped_bytes >= kv and held_back > 0, (rate, shaped_bytes, held_back)
