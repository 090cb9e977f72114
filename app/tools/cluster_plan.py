"""A multi-node Ray cluster on one machine: which namespaces, links, addresses and ``ray start``
flags (pure; ``app.tools.cluster`` runs it).

Three Ray nodes, each in its own Linux network namespace with its own address on a bridge in
the root namespace: the head (GCS, Serve's controller and HTTP proxy, the ingress) and one
worker per role, offering the custom resource its k8s worker group offers (``prefill_group``,
``decode_group``), so a config's ``prefill.resources`` / ``decode.resources`` place replicas as
on Kubernetes. Every engine then advertises its own node's address as its NIXL side channel and
KV crosses the veths, as it crosses a network between machines.

The root namespace gets an address on the bridge too, so clients on this host reach the head's
HTTP proxy; the namespaces have no default route, so nothing leaves the bridge.

With GCS fault tolerance (``gcs_ft``), as ``k8s/components/gcs-ft`` sets it up on Kubernetes: a Redis of its own
in a fourth namespace (not the head's, so that it outlives the head), the head's GCS keeping its state there, every
node waiting up to ``GCS_RECONNECT_TIMEOUT_S`` for a GCS that went, the head offering Ray no CPU, and clients
reaching a worker node's proxy instead of the head's.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from deploy.checks import ray_start_resources  # the parser of rayStartParams the k8s checks use

# RFC 1918. Not TEST-NET-1 (192.0.2.0/24): that is this machine's own eth0 network.
DEFAULT_SUBNET = "10.213.0.0/24"
DEFAULT_PREFIX = "rdv"
# The namespace side of each veth pair: every node sees the same name (as a pod sees eth0), so
# one config can pin UCX to it (UCX_NET_DEVICES).
NS_DEVICE = "eth0"
GCS_PORT = 6379
REDIS_PORT = 6379  # in the Redis namespace's own port space
# KubeRay's value for GCS fault tolerance (Ray's default is 60 s): how long a raylet, and every worker and replica
# of its node, waits for the GCS to come back before it exits. A head restart must fit in it.
GCS_RECONNECT_TIMEOUT_S = 600
# Ray's default, as on the k8s pods; each namespace has its own port space.
METRICS_PORT = 8080
# Ray's default object store is 30 % of RAM per node; Serve needs little, and three nodes share one box.
OBJECT_STORE_BYTES = 256 << 20
_IFNAMSIZ = 15  # Linux interface names: at most 15 characters
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,6}$")


# A shaped link (``LinkShape``): tbf queues at most this long before it drops, and lets bursts of this many bytes
# through at once. veth hands tbf segments of up to 64 KiB (GSO), and tbf drops a packet larger than its burst.
SHAPE_LATENCY_MS = 50
SHAPE_MIN_BURST_BYTES = 256 << 10


class NodeKind(str, Enum):
    HEAD = "head"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Node:
    kind: NodeKind
    namespace: str
    host_link: str  # the root-namespace end of the node's veth pair, a port of the bridge
    interface: ipaddress.IPv4Interface  # the node's address, on NS_DEVICE in its namespace
    temp_dir: str  # Ray's --temp-dir: nodes on one machine must not share sessions or sockets
    num_cpus: int
    resources: Mapping[str, float] = field(default_factory=dict)

    @property
    def ip(self) -> str:
        return str(self.interface.ip)

    @property
    def rpc_dir(self) -> str:
        """Where the node's vLLM processes make their ZeroMQ IPC sockets (``VLLM_RPC_BASE_PATH``; vLLM's default,
        /tmp, keeps the sockets of every engine that was killed): the cluster removes it with its nodes."""
        return f"{self.temp_dir}/vllm-rpc"


@dataclass(frozen=True)
class RedisHost:
    """The external store of the GCS's state (``gcs_ft``): a namespace of its own, with no Ray in it."""

    namespace: str
    host_link: str
    interface: ipaddress.IPv4Interface
    data_dir: str  # its config (with the password) and log; removed with the cluster

    @property
    def address(self) -> str:
        return f"{self.interface.ip}:{REDIS_PORT}"

    def config(self, password: str) -> str:
        """redis.conf: this address only, a password, and no persistence: the GCS's state lives as long as
        this Redis does (a head restart, not a Redis restart, is what it is for)."""
        return "\n".join([
            f"bind {self.interface.ip}",
            f"port {REDIS_PORT}",
            f"requirepass {password}",
            'save ""',
            "appendonly no",
            f"dir {self.data_dir}",
            f"logfile {self.data_dir}/redis.log",
            "daemonize no",
            "",
        ])


@dataclass(frozen=True)
class LinkShape:
    """Each worker node's link at ``mbit`` megabits per second, both ways, as a NIC of that rate would be: Linux's
    token bucket filter on both ends of the node's veth pair (egress out of the node in its namespace, egress into
    it on the host end). This kernel has ``tbf``, not ``netem``: a rate, no added delay or loss. The head's link is
    not shaped (control traffic); KV between prefill and decode crosses two shaped ends at the same rate."""

    mbit: float

    def __post_init__(self):
        if not 1 <= self.mbit <= 100_000:
            raise ValueError(f"link rate {self.mbit:g} Mbit/s: between 1 and 100000")

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8

    @property
    def burst_bytes(self) -> int:
        return max(SHAPE_MIN_BURST_BYTES, int(self.bytes_per_s * 0.005))  # 5 ms of the rate, at least a few GSO segments

    def qdisc(self) -> list[str]:
        return ["tbf", "rate", f"{self.mbit:g}mbit", "burst", str(self.burst_bytes), "latency", f"{SHAPE_LATENCY_MS}ms"]


@dataclass(frozen=True)
class ClusterPlan:
    prefix: str
    bridge: str
    gateway: ipaddress.IPv4Interface  # the root namespace's address on the bridge
    nodes: tuple[Node, ...]
    link: LinkShape | None = None  # None: the veths run as fast as the host copies
    redis: RedisHost | None = None  # GCS fault tolerance; None: the GCS keeps its state in the head's memory

    @property
    def gcs_ft(self) -> bool:
        return self.redis is not None

    @property
    def client_node(self) -> Node:
        """The node whose Serve proxy clients reach: the head's, or with GCS fault tolerance a worker's, which
        outlives the head (as ``excludeHeadPodFromServeSvc`` does on Kubernetes)."""
        return self.node(NodeKind.DECODE if self.gcs_ft else NodeKind.HEAD)

    @property
    def head(self) -> Node:
        return self.node(NodeKind.HEAD)

    def node(self, kind: NodeKind) -> Node:
        return next(n for n in self.nodes if n.kind is kind)

    @property
    def gcs_address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    def base_url(self, http_port: int) -> str:
        """Where Serve's HTTP proxy (``client_node``'s, bound to 0.0.0.0) answers clients on this host."""
        return f"http://{self.client_node.ip}:{http_port}"

    def metrics_url(self, kind: NodeKind) -> str:
        return f"http://{self.node(kind).ip}:{METRICS_PORT}/metrics"

    @property
    def hosts(self) -> list[Node | RedisHost]:
        """Every namespace's host: the Ray nodes, then Redis."""
        return [*self.nodes, *([self.redis] if self.redis else [])]

    @property
    def namespaces(self) -> list[str]:
        return [h.namespace for h in self.hosts]

    @property
    def links(self) -> list[str]:
        """Every link the plan creates in the root namespace."""
        return [self.bridge, *(h.host_link for h in self.hosts)]

    def network_commands(self) -> list[list[str]]:
        """``ip`` commands that build the network, in order (each fails if its object exists)."""
        commands = [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", str(self.gateway), "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ]
        for n in self.hosts:
            commands += [
                ["ip", "netns", "add", n.namespace],
                ["ip", "link", "add", n.host_link, "type", "veth", "peer", "name", NS_DEVICE, "netns", n.namespace],
                ["ip", "link", "set", n.host_link, "master", self.bridge],
                ["ip", "link", "set", n.host_link, "up"],
                ["ip", "-n", n.namespace, "addr", "add", str(n.interface), "dev", NS_DEVICE],
                ["ip", "-n", n.namespace, "link", "set", NS_DEVICE, "up"],
                # Ray, Serve and vLLM also talk to 127.0.0.1 inside a node.
                ["ip", "-n", n.namespace, "link", "set", "lo", "up"],
            ]
        return commands + self.shaping_commands()

    @property
    def shaped_nodes(self) -> list[Node]:
        return [] if self.link is None else [n for n in self.nodes if n.kind is not NodeKind.HEAD]

    def shaping_commands(self) -> list[list[str]]:
        """``tc`` commands that shape the worker nodes' links (``LinkShape``); none without a link rate. Deleting
        a namespace deletes both ends of its veth pair, and their qdiscs with them."""
        if self.link is None:
            return []
        commands = []
        for n in self.shaped_nodes:
            commands += [
                ["tc", "-n", n.namespace, "qdisc", "add", "dev", NS_DEVICE, "root", *self.link.qdisc()],  # out of it
                ["tc", "qdisc", "add", "dev", n.host_link, "root", *self.link.qdisc()],  # into it
            ]
        return commands

    def teardown_commands(self, namespaces: Iterable[str], links: Iterable[str]) -> list[list[str]]:
        """``ip`` commands that remove what exists of the plan (``namespaces`` and root-namespace
        ``links`` found now). Deleting a namespace deletes its veth end and so the pair; a link
        left in the root namespace (a half-built node) is deleted by name; the bridge last."""
        present_ns, present_links = set(namespaces), set(links)
        commands = [["ip", "netns", "del", ns] for ns in self.namespaces if ns in present_ns]
        commands += [["ip", "link", "del", n.host_link] for n in self.hosts
                     if n.host_link in present_links and n.namespace not in present_ns]
        if self.bridge in present_links:
            commands.append(["ip", "link", "del", self.bridge])
        return commands

    def node_env(self, node: Node) -> dict[str, str]:
        """What ``ray start`` on ``node`` needs in its environment beyond the run's: with GCS fault tolerance, the
        head's GCS finds its store in ``RAY_REDIS_ADDRESS`` (and its state there, after a restart), and every node
        waits for a GCS that went (``GCS_RECONNECT_TIMEOUT_S``), as KubeRay sets them."""
        if not self.gcs_ft:
            return {}
        env = {"RAY_gcs_rpc_server_reconnect_timeout_s": str(GCS_RECONNECT_TIMEOUT_S)}
        if node.kind is NodeKind.HEAD:
            env["RAY_REDIS_ADDRESS"] = self.redis.address
        return env

    def ray_start_command(self, node: Node, ray: str = "ray", redis_password: str | None = None) -> list[str]:
        """``ray start`` for ``node``, run inside its namespace (``in_namespace``); the head's takes the Redis
        password with GCS fault tolerance."""
        common = [
            f"--node-ip-address={node.ip}",
            f"--temp-dir={node.temp_dir}",
            f"--num-cpus={node.num_cpus}",
            "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            f"--metrics-export-port={METRICS_PORT}",
            "--disable-usage-stats",
        ]
        if node.kind is NodeKind.HEAD:
            # No dashboard: `serve run` does not need it, and it costs a few processes on a small box.
            head = [ray, "start", "--head", f"--port={GCS_PORT}", "--include-dashboard=false", *common]
            if self.gcs_ft:
                if not redis_password:
                    raise ValueError("GCS fault tolerance: the head needs the Redis password")
                head.append(f"--redis-password={redis_password}")
            return head
        resources = json.dumps(dict(node.resources), sort_keys=True)
        return [ray, "start", f"--address={self.gcs_address}", *common, f"--resources={resources}"]


def auth_env(token: str) -> dict[str, str]:
    """Ray 2.60's token authentication for every process of the cluster (nodes, driver, and so
    replicas and engines). ``ray start --head`` turns it on by itself when ~/.ray/auth_token exists
    (a local ``ray.init`` writes one) and workers do not: they are refused. Turned on explicitly,
    with a token of the cluster's own, every node and the driver agree whatever ~/.ray holds."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def in_namespace(namespace: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def worker_group_resources(rayservice: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """The custom Ray resources each worker group of a RayService manifest offers, by group name
    (``k8s/base/rayservice.yaml``: prefill → {prefill_group: 100}): one home for them."""
    groups = rayservice["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []
    return {g["groupName"]: ray_start_resources((g.get("rayStartParams") or {}).get("resources")) for g in groups}


def plan_cluster(
    worker_resources: Mapping[str, Mapping[str, float]],
    *,
    prefix: str = DEFAULT_PREFIX,
    subnet: str = DEFAULT_SUBNET,
    head_cpus: int = 2,
    worker_cpus: int = 2,
    temp_root: str = "/tmp",
    link_mbit: float | None = None,
    gcs_ft: bool = False,
) -> ClusterPlan:
    """The cluster's plan. ``worker_resources``: each role's worker group resources (by group
    name ``prefill`` / ``decode``); ``link_mbit``: the worker nodes' link rate (``LinkShape``), or
    unshaped; ``gcs_ft``: GCS fault tolerance on a Redis of the cluster's own, and a head that offers
    Ray no CPU (``k8s/components/gcs-ft``). Raises ValueError saying why not."""
    if not _PREFIX.match(prefix):
        raise ValueError(f"prefix {prefix!r}: 1-7 lowercase letters or digits, starting with a letter "
                         f"(interface names are '<prefix>-prefill', at most {_IFNAMSIZ} characters)")
    missing = [k.value for k in (NodeKind.PREFILL, NodeKind.DECODE) if not worker_resources.get(k.value)]
    if missing:
        raise ValueError(f"no custom resources for worker group(s) {missing}: replicas could not be placed by role")
    try:
        net = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise ValueError(f"subnet {subnet!r}: {e}") from None
    if not net.is_private:
        raise ValueError(f"subnet {subnet}: not a private network; the bridge would shadow real hosts")
    wanted = 1 + len(NodeKind) + gcs_ft
    hosts = list(_first_hosts(net, wanted))
    if len(hosts) < wanted:
        raise ValueError(f"subnet {subnet}: too small for the bridge, {len(NodeKind)} nodes"
                         f"{' and Redis' if gcs_ft else ''}")
    gateway, *addresses = (ipaddress.IPv4Interface(f"{ip}/{net.prefixlen}") for ip in hosts)
    if gcs_ft:
        head_cpus = 0  # nothing that asks for CPU lands on the head: it all outlives a head restart
    nodes = tuple(
        Node(
            kind=kind,
            namespace=f"{prefix}-{kind.value}",
            host_link=f"{prefix}-{kind.value}",
            interface=address,
            temp_dir=f"{temp_root}/{prefix}-{kind.value}",
            num_cpus=head_cpus if kind is NodeKind.HEAD else worker_cpus,
            resources={} if kind is NodeKind.HEAD else dict(worker_resources[kind.value]),
        )
        for kind, address in zip(NodeKind, addresses)
    )
    link = None if link_mbit is None else LinkShape(link_mbit)
    redis = RedisHost(namespace=f"{prefix}-redis", host_link=f"{prefix}-redis", interface=addresses[-1],
                      data_dir=f"{temp_root}/{prefix}-redis") if gcs_ft else None
    return ClusterPlan(prefix=prefix, bridge=f"{prefix}-br", gateway=gateway, nodes=nodes, link=link, redis=redis)


def host_conflict(plan: ClusterPlan, taken: Iterable[str]) -> str | None:
    """Why the plan's subnet cannot be used next to ``taken`` (the root namespace's addresses and
    routes, before the cluster exists), or None: an overlap would send this host's traffic for
    real machines onto the bridge."""
    net = plan.gateway.network
    for other in taken:
        other_net = ipaddress.ip_network(other, strict=False)
        if other_net.version == 4 and other_net.overlaps(net):
            return f"subnet {net} overlaps {other}, already on this host; choose another (--subnet)"
    return None


def _first_hosts(net: ipaddress.IPv4Network, count: int):
    for i, host in enumerate(net.hosts()):
        if i == count:
            return
        yield host
