"""app.tools.cluster_plan: the one-machine Ray cluster's namespaces, links, addresses and ``ray start``
flags (pure: nothing is started), and what app.tools.cluster and configs/local-cpu-2node.yaml take from it."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from app.config.args import AppArgs
from app.tools.cluster_plan import (
    NS_DEVICE,
    LinkShape,
    NodeKind,
    auth_env,
    host_conflict,
    in_namespace,
    plan_cluster,
    worker_group_resources,
)
from connector.ports import Role
from tests.support.layering import HEAVY, repo_closure

REPO = Path(__file__).resolve().parents[3]
K8S = {"prefill": {"prefill_group": 100.0}, "decode": {"decode_group": 100.0}}
CONFIG = REPO / "configs" / "local-cpu-2node.yaml"


def plan(**kwargs):
    return plan_cluster(K8S, **kwargs)


def test_the_default_plan():
    p = plan()
    assert [n.rpc_dir for n in p.nodes] == [f"/tmp/rdv-{kind}/vllm-rpc" for kind in ("head", "prefill", "decode")]
    assert p.bridge == "rdv-br" and str(p.gateway) == "10.213.0.1/24"
    assert [(n.kind, n.namespace, n.host_link, str(n.interface), n.temp_dir) for n in p.nodes] == [
        (NodeKind.HEAD, "rdv-head", "rdv-head", "10.213.0.2/24", "/tmp/rdv-head"),
        (NodeKind.PREFILL, "rdv-prefill", "rdv-prefill", "10.213.0.3/24", "/tmp/rdv-prefill"),
        (NodeKind.DECODE, "rdv-decode", "rdv-decode", "10.213.0.4/24", "/tmp/rdv-decode"),
    ]
    assert [dict(n.resources) for n in p.nodes] == [{}, {"prefill_group": 100.0}, {"decode_group": 100.0}]
    assert p.gcs_address == "10.213.0.2:6379"
    assert p.base_url(8000) == "http://10.213.0.2:8000"
    assert p.metrics_url(NodeKind.PREFILL) == "http://10.213.0.3:8080/metrics"
    assert p.links == ["rdv-br", "rdv-head", "rdv-prefill", "rdv-decode"]


@pytest.mark.parametrize("kwargs, addresses", [
    ({"subnet": "10.99.7.0/29"}, ["10.99.7.1/29", "10.99.7.2/29", "10.99.7.3/29", "10.99.7.4/29"]),
    ({"subnet": "172.31.200.0/24", "prefix": "ci7"}, ["172.31.200.1/24", "172.31.200.2/24", "172.31.200.3/24", "172.31.200.4/24"]),
    ({"subnet": "198.51.100.0/24"}, ["198.51.100.1/24", "198.51.100.2/24", "198.51.100.3/24", "198.51.100.4/24"]),  # TEST-NET-2
])
def test_addresses_come_from_the_subnet_in_order(kwargs, addresses):
    p = plan(**kwargs)
    assert [str(p.gateway), *(str(n.interface) for n in p.nodes)] == addresses
    assert len({p.bridge, *p.links}) == 4 and all(len(name) <= 15 for name in p.links)


@pytest.mark.parametrize("kwargs, resources, error", [
    ({"prefix": "rendezvous"}, K8S, "1-7 lowercase"),  # rendezvous-prefill: 18 characters, over IFNAMSIZ
    ({"prefix": "Rdv"}, K8S, "1-7 lowercase"),
    ({"prefix": "r-d"}, K8S, "1-7 lowercase"),
    ({"subnet": "8.8.8.0/24"}, K8S, "not a private network"),
    ({"subnet": "10.0.0.0/30"}, K8S, "too small"),
    ({"subnet": "10.213.0.5/24"}, K8S, "host bits set"),
    ({"subnet": "nonsense"}, K8S, "subnet 'nonsense'"),
    ({}, {"prefill": {"prefill_group": 100}}, "['decode']"),
    ({}, {"prefill": {}, "decode": {"decode_group": 1}}, "['prefill']"),
])
def test_plans_that_cannot_work_are_refused(kwargs, resources, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        plan_cluster(resources, **kwargs)


@pytest.mark.parametrize("taken, conflict", [
    (["192.0.2.2/24", "192.0.2.0/24", "127.0.0.1/8"], None),  # this machine: eth0 is on TEST-NET-1
    (["10.213.0.1/24"], "overlaps 10.213.0.1/24"),  # a cluster that was not torn down (its bridge)
    (["10.0.0.0/8"], "overlaps 10.0.0.0/8"),
    (["10.213.0.128/25"], "overlaps 10.213.0.128/25"),
    (["fd00::2/64", "10.214.0.0/24"], None),
])
def test_the_subnet_must_not_overlap_a_network_of_the_host(taken, conflict):
    found = host_conflict(plan(), taken)
    assert (found is None) if conflict is None else (conflict in found)


def test_network_commands_build_a_bridge_and_one_veth_per_namespace():
    p = plan()
    commands = [" ".join(c) for c in p.network_commands()]
    assert commands[:3] == ["ip link add rdv-br type bridge", "ip addr add 10.213.0.1/24 dev rdv-br", "ip link set rdv-br up"]
    assert commands[3:10] == [
        "ip netns add rdv-head",
        f"ip link add rdv-head type veth peer name {NS_DEVICE} netns rdv-head",
        "ip link set rdv-head master rdv-br",
        "ip link set rdv-head up",
        f"ip -n rdv-head addr add 10.213.0.2/24 dev {NS_DEVICE}",
        f"ip -n rdv-head link set {NS_DEVICE} up",
        "ip -n rdv-head link set lo up",
    ]
    assert len(commands) == 3 + 7 * 3
    # No route anywhere but the bridge's own subnet: nothing can leave this machine.
    assert not [c for c in commands if " route " in c]


def test_a_link_rate_shapes_both_ends_of_each_worker_nodes_veth_after_the_network_is_built():
    unshaped, shaped = plan().network_commands(), plan(link_mbit=300).network_commands()
    assert shaped[:len(unshaped)] == unshaped  # the same network first: tc needs the links
    tbf = "tbf rate 300mbit burst 262144 latency 50ms"
    assert [" ".join(c) for c in shaped[len(unshaped):]] == [
        f"tc -n rdv-prefill qdisc add dev {NS_DEVICE} root {tbf}", f"tc qdisc add dev rdv-prefill root {tbf}",
        f"tc -n rdv-decode qdisc add dev {NS_DEVICE} root {tbf}", f"tc qdisc add dev rdv-decode root {tbf}",
    ]
    assert plan().shaping_commands() == [] and plan().link is None


@pytest.mark.parametrize("mbit, burst", [(1, 256 << 10), (300, 256 << 10), (10_000, 6_250_000)])
def test_the_burst_is_5_ms_of_the_rate_and_never_less_than_a_few_gso_segments(mbit, burst):
    assert LinkShape(mbit).burst_bytes == burst


@pytest.mark.parametrize("mbit", [0, 0.5, -3, 200_000])
def test_a_link_rate_out_of_range_is_refused(mbit):
    with pytest.raises(ValueError, match="link rate"):
        plan(link_mbit=mbit)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("tc"), reason="needs root and iproute2's tc")
def test_this_kernel_takes_the_shape_and_the_cluster_reads_its_rate_back(tmp_path):
    """The plan's tc commands on a real namespace and veth pair (a throwaway prefix), and app.tools.cluster's
    reading of the live qdisc: the rate a bench records and the bytes that went through it."""
    from app.tools.cluster import link_mbit, shaped_out

    p = plan(prefix="rdvtbf", subnet="10.214.0.0/24", link_mbit=300)
    node = p.node(NodeKind.PREFILL)
    setup = [["ip", "netns", "add", node.namespace],
             ["ip", "link", "add", node.host_link, "type", "veth", "peer", "name", NS_DEVICE, "netns", node.namespace],
             ["ip", "-n", node.namespace, "link", "set", NS_DEVICE, "up"]]
    try:
        for argv in setup + [c for c in p.shaping_commands() if node.namespace in c or node.host_link in c]:
            subprocess.run(argv, check=True, capture_output=True)
        assert link_mbit(p) == 300.0 and shaped_out(p, NodeKind.PREFILL) == (0, 0)
    finally:
        subprocess.run(["ip", "netns", "del", node.namespace], capture_output=True)
    assert link_mbit(p) is None  # gone with its namespace


@pytest.mark.parametrize("namespaces, links, expected", [
    ([], [], []),
    (["rdv-head", "rdv-prefill", "rdv-decode"], ["rdv-br", "rdv-head", "rdv-prefill", "rdv-decode"],
     ["ip netns del rdv-head", "ip netns del rdv-prefill", "ip netns del rdv-decode", "ip link del rdv-br"]),
    # Half-built: the decode veth was made, its namespace's end not moved in yet; no bridge address.
    (["rdv-head", "rdv-decode"], ["rdv-br", "rdv-head", "rdv-prefill"],
     ["ip netns del rdv-head", "ip netns del rdv-decode", "ip link del rdv-prefill", "ip link del rdv-br"]),
    ([], ["rdv-br"], ["ip link del rdv-br"]),
    (["other-ns"], ["eth0", "docker0"], []),  # never anything that is not the plan's
])
def test_teardown_removes_exactly_what_exists_of_the_plan(namespaces, links, expected):
    assert [" ".join(c) for c in plan().teardown_commands(namespaces, links)] == expected


def test_ray_start_commands():
    p = plan()
    head, prefill, decode = p.nodes
    head_cmd = p.ray_start_command(head, "/venv/bin/ray")
    assert head_cmd[:4] == ["/venv/bin/ray", "start", "--head", "--port=6379"]
    assert "--node-ip-address=10.213.0.2" in head_cmd and "--temp-dir=/tmp/rdv-head" in head_cmd
    assert not [a for a in head_cmd if a.startswith(("--address", "--resources"))]
    for node, resource in ((prefill, "prefill_group"), (decode, "decode_group")):
        cmd = p.ray_start_command(node)
        assert cmd[:3] == ["ray", "start", "--address=10.213.0.2:6379"]
        assert f"--node-ip-address={node.ip}" in cmd and f"--temp-dir={node.temp_dir}" in cmd
        (resources,) = [a.split("=", 1)[1] for a in cmd if a.startswith("--resources=")]
        assert json.loads(resources) == {resource: 100.0}
        assert not [a for a in cmd if a.startswith(("--head", "--port", "--include-dashboard"))]  # head-only flags
    assert in_namespace("rdv-head", ["ray", "status"]) == ["ip", "netns", "exec", "rdv-head", "ray", "status"]


def test_worker_resources_are_the_k8s_worker_groups():
    """One home: the resources each node offers are read from the RayService's worker groups."""
    rayservice = yaml.safe_load((REPO / "k8s" / "base" / "rayservice.yaml").read_text())
    assert worker_group_resources(rayservice) == K8S


def test_the_2node_config_lands_each_role_on_its_node():
    """configs/local-cpu-2node.yaml asks for what exactly one worker offers, and pins UCX to TCP on
    the namespaces' interface (else it could take shared memory between "hosts" of one kernel)."""
    raw = yaml.safe_load(CONFIG.read_text())
    args = AppArgs.parse(raw["applications"][0]["args"])
    p = plan()
    for role, kind in ((Role.PREFILL, NodeKind.PREFILL), (Role.DECODE, NodeKind.DECODE)):
        asked = args.role(role).resources
        offering = [n.kind for n in p.nodes if all(n.resources.get(k, 0) >= v for k, v in asked.items())]
        assert offering == [kind], f"{role} asks {asked}, offered by {offering}"
        env = args.role(role).env
        assert "shm" not in env["UCX_TLS"] and "tcp" in env["UCX_TLS"] and env["UCX_NET_DEVICES"] == NS_DEVICE
    assert raw["http_options"]["host"] == "0.0.0.0", "clients on this host reach the head's proxy over the bridge"
    assert raw["proxy_location"] == "HeadOnly"


def test_the_plan_module_is_pure():
    bad = [str(i) for i in repo_closure("app/tools/cluster_plan.py") if i.top in HEAVY | {"subprocess"}]
    assert not bad, bad


def test_addresses_are_valid_interfaces():
    for node in plan().nodes:
        assert isinstance(node.interface, ipaddress.IPv4Interface) and node.interface.network == plan().gateway.network


def test_every_process_of_the_cluster_gets_token_auth():
    """Explicit: ray start --head would turn it on alone when ~/.ray/auth_token exists, and refuse the workers."""
    assert auth_env("abc") == {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "abc"}


def test_the_cluster_doc_names_only_files_that_exist():
    text = (REPO / "docs" / "cluster.md").read_text()
    paths = set(re.findall(r"\b((?:configs|k8s|deploy|docker|connector|app|tests)/[\w./-]*\w)", text))
    assert "configs/local-cpu-2node.yaml" in paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, missing


def test_gcs_fault_tolerance_adds_a_redis_namespace_and_moves_clients_off_the_head():
    p = plan(gcs_ft=True)
    assert p.gcs_ft and not plan().gcs_ft
    assert (p.redis.namespace, str(p.redis.interface), p.redis.address) == ("rdv-redis", "10.213.0.5/24", "10.213.0.5:6379")
    assert p.namespaces == ["rdv-head", "rdv-prefill", "rdv-decode", "rdv-redis"]
    assert p.links == ["rdv-br", "rdv-head", "rdv-prefill", "rdv-decode", "rdv-redis"]
    assert ["ip", "netns", "add", "rdv-redis"] in p.network_commands()
    assert p.base_url(8000) == "http://10.213.0.4:8000"  # the decode node's proxy; the head's outside FT
    assert p.head.num_cpus == 0  # nothing that asks for CPU lands on the head
    head, worker = p.node(NodeKind.HEAD), p.node(NodeKind.DECODE)
    assert p.node_env(head) == {"RAY_gcs_rpc_server_reconnect_timeout_s": "600", "RAY_REDIS_ADDRESS": "10.213.0.5:6379"}
    assert p.node_env(worker) == {"RAY_gcs_rpc_server_reconnect_timeout_s": "600"}
    assert plan().node_env(head) == {}
    assert "--redis-password=pw" in p.ray_start_command(head, redis_password="pw")
    assert not any(a.startswith("--redis") for a in p.ray_start_command(worker, redis_password="pw"))
    with pytest.raises(ValueError, match="Redis password"):
        p.ray_start_command(head)
    conf = p.redis.config("pw")
    assert "bind 10.213.0.5" in conf and "requirepass pw" in conf and 'save ""' in conf
    with pytest.raises(ValueError, match="and Redis"):
        plan(subnet="10.99.7.0/30", gcs_ft=True)


def test_the_ft_config_passes_the_checks_kubernetes_applies_and_the_plain_one_does_not():
    from app.tools.cluster_redis import ft_config_problem

    assert ft_config_problem(str(REPO / "configs" / "local-cpu-2node-ft.yaml")) is None
    problems = ft_config_problem(str(CONFIG))
    assert "ingress.on_head is true" in problems and "proxy_location 'HeadOnly'" in problems
