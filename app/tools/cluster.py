"""``python -m app.tools.cluster up|down``: a head, a prefill and a decode Ray node on this machine, each
in its own network namespace with its own address (``app.tools.cluster_plan`` decides which), and the
app served on them (docs/cluster.md). Root only (``ip netns``), as CI runs.

``up [CONFIG]`` builds the network, starts Ray on each node with ``ray start`` and runs
``python -m app.tools.run CONFIG`` (what ``make serve`` runs) in the head's namespace, in the
foreground; however it ends (Ctrl-C, SIGTERM, a failed start), it tears everything down.
``up --no-app`` leaves the bare cluster running instead; ``up --link-mbit R`` shapes the prefill and decode
nodes' links to R Mbit/s (``cluster_plan.LinkShape``). ``down`` removes whatever exists of a
cluster, half-built or not: every process in its namespaces, the namespaces, veths and bridge.

``kill-node NODE`` ends every process of one worker node at once (SIGKILL), as if its host
vanished, and ``rejoin NODE`` starts Ray there again with the same resources: Serve places the
node's replicas on it again. Both read the running cluster's join settings (its auth token and
run id) from a file ``up`` keeps in the head's temp dir (``join_file``; root only).

``up --gcs-ft`` adds GCS fault tolerance (``cluster_plan``, "gcs_ft"): Redis in a namespace of its own, the
app deployed without a driver (``serve run --non-blocking``: no process of ours on the head that a head
restart would end), clients on the decode node's proxy. Then ``kill-node head`` / ``rejoin head`` restart
the head with the same Redis, and ``app.tools.drill`` measures what that costs the traffic.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from app.tools.cluster_plan import (
    DEFAULT_PREFIX,
    DEFAULT_SUBNET,
    NS_DEVICE,
    ClusterPlan,
    Node,
    NodeKind,
    auth_env,
    host_conflict,
    in_namespace,
    plan_cluster,
    worker_group_resources,
)
from app.tools.cluster_redis import ft_config_problem, start_redis
from app.tools.procs import MARKER, REPO, base_url_of, find_processes, kill, new_run_env, read_readiness, running

DEFAULT_CONFIG = "configs/local-cpu-2node.yaml"
DEFAULT_FT_CONFIG = "configs/local-cpu-2node-ft.yaml"
RAYSERVICE = REPO / "k8s" / "base" / "rayservice.yaml"  # the worker groups' resources live there
_STOP_GRACE_S = 120  # app.tools.run's own grace (90 s) plus its sweep


def _say(line: str) -> None:
    print(f"[rendezvous] {line}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- what exists


def _ip_json(*args: str) -> list[dict]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out or "[]")


def host_networks() -> list[str]:
    """IPv4 networks of the root namespace's addresses and routes: what the subnet must not overlap."""
    nets = [f"{a['local']}/{a['prefixlen']}" for link in _ip_json("-4", "addr") for a in link.get("addr_info", [])]
    nets += [r["dst"] for r in _ip_json("-4", "route") if r.get("dst") not in (None, "default")]
    return nets


def present(plan: ClusterPlan) -> tuple[list[str], list[str]]:
    """The plan's namespaces and root-namespace links that exist now."""
    namespaces = {line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()}
    links = {link["ifname"] for link in _ip_json("link")}
    return [ns for ns in plan.namespaces if ns in namespaces], [link for link in plan.links if link in links]


def namespace_pids(namespaces: list[str]) -> list[int]:
    """Every process in ``namespaces``: Ray's, the app's and vLLM's, orphans included."""
    pids: set[int] = set()
    for ns in namespaces:
        pids |= {int(p) for p in _run(["ip", "netns", "pids", ns]).stdout.split()}
    return sorted(pids - {os.getpid()})


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **kwargs)


# --------------------------------------------------------------------------- build and tear down


def load_plan(prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET, link_mbit: float | None = None,
              gcs_ft: bool = False) -> ClusterPlan:
    resources = worker_group_resources(yaml.safe_load(RAYSERVICE.read_text()))
    return plan_cluster(resources, prefix=prefix, subnet=subnet, link_mbit=link_mbit, gcs_ft=gcs_ft)


def running_plan(prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> ClusterPlan:
    """The plan of the cluster running now: with GCS fault tolerance if its Redis namespace is there."""
    redis_namespace = load_plan(prefix, subnet, gcs_ft=True).redis.namespace
    namespaces = {line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()}
    return load_plan(prefix, subnet, gcs_ft=redis_namespace in namespaces)


def _tbf(node: Node) -> dict | None:
    """The tbf qdisc shaping traffic out of ``node`` (``LinkShape``), as ``tc -s -j`` reports it, or None."""
    out = subprocess.run(["tc", "-s", "-j", "-n", node.namespace, "qdisc", "show", "dev", NS_DEVICE],
                         capture_output=True, text=True)
    try:
        qdiscs = json.loads(out.stdout) if out.returncode == 0 else []
    except ValueError:
        return None
    return next((q for q in qdiscs if q.get("kind") == "tbf"), None)


def link_mbit(plan: ClusterPlan, kind: NodeKind = NodeKind.PREFILL) -> float | None:
    """The rate the running cluster's ``kind`` node's link is shaped to (Mbit/s), read from the kernel; None if unshaped."""
    tbf = _tbf(plan.node(kind))
    return None if tbf is None else tbf["options"]["rate"] * 8 / 1e6


def shaped_out(plan: ClusterPlan, kind: NodeKind) -> tuple[int, int]:
    """(bytes, overlimits) of the ``kind`` node's shaped link out so far, (0, 0) if unshaped: the bytes that went
    through the token bucket, and how often a packet had to wait for tokens (the rate held them back)."""
    tbf = _tbf(plan.node(kind))
    return (0, 0) if tbf is None else (int(tbf["bytes"]), int(tbf["overlimits"]))


def build(plan: ClusterPlan, env: dict[str, str], redis_password: str | None = None) -> None:
    """The network, Redis (GCS fault tolerance), then Ray on each node (head first). Raises RuntimeError on the
    first failure; the caller tears down."""
    for argv in plan.network_commands():
        _check(argv)
    if (redis := plan.redis) is not None:
        start_redis(redis, env, redis_password)
        _say(f"redis: {redis.address} in namespace {redis.namespace} (the GCS's store; logs: {redis.data_dir})")
    for node in plan.nodes:  # head first: the workers join it
        start_node(plan, node, env, redis_password)
        if node.kind is NodeKind.HEAD:
            _keep_join_env(plan, env, redis_password)


def start_node(plan: ClusterPlan, node: Node, env: dict[str, str], redis_password: str | None = None) -> None:
    ray = str(Path(sys.executable).with_name("ray"))
    node_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"} | plan.node_env(node)
    Path(node.rpc_dir).mkdir(parents=True, exist_ok=True)
    node_env["VLLM_RPC_BASE_PATH"] = node.rpc_dir  # the raylet's workers, and so the node's engines, inherit it
    # `ray start` returns once its node has registered with the GCS.
    _check(in_namespace(node.namespace, plan.ray_start_command(node, ray, redis_password)), env=node_env,
           start_new_session=True)  # raylets must not get a terminal's Ctrl-C: teardown ends them
    _say(f"ray node {node.kind.value}: {node.ip} in namespace {node.namespace} (logs: {node.temp_dir})")


def join_file(plan: ClusterPlan) -> Path:
    """What a node needs to join the running cluster (auth token, run id, Redis password): kept by ``up``."""
    return Path(plan.head.temp_dir) / "rendezvous-join.json"


def _keep_join_env(plan: ClusterPlan, env: dict[str, str], redis_password: str | None) -> None:
    path = join_file(plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the token is the cluster's password
    with os.fdopen(fd, "w") as f:
        json.dump({"env": {k: env[k] for k in (MARKER, *auth_env("").keys())}, "redis_password": redis_password}, f)


def kill_node(plan: ClusterPlan, kind: NodeKind) -> list[int]:
    """SIGKILL every process of one node (its raylet, workers, replicas, engines; the head's GCS and Serve's
    controller): a lost host. Returns the pids that were there."""
    namespace, killed = plan.node(kind).namespace, set()
    deadline = time.monotonic() + 20
    # Again until none is left: a process forked while the first signals land was not listed.
    while (pids := running(namespace_pids([namespace]))) and time.monotonic() < deadline:
        for pid in pids:  # no SIGTERM first: a raylet told to stop would say goodbye to the GCS
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        time.sleep(0.2)
    if pids:
        raise RuntimeError(f"node {kind.value}: processes {pids} outlived SIGKILL")
    return sorted(killed)


def rejoin(plan: ClusterPlan, kind: NodeKind) -> None:
    """Start Ray on a node of the running cluster again (after ``kill_node`` or a crash)."""
    node = plan.node(kind)
    if node.namespace not in present(plan)[0]:
        raise RuntimeError(f"no namespace {node.namespace}: is the cluster up?")
    if left := running(namespace_pids([node.namespace])):
        raise RuntimeError(f"node {kind.value} still has processes {left}: `python -m app.tools.cluster kill-node {kind.value}` first")
    if kind is NodeKind.HEAD and not plan.gcs_ft:
        raise RuntimeError("without GCS fault tolerance (up --gcs-ft) a new head starts an empty cluster")
    if kind is NodeKind.HEAD:
        # `ray start --head` refuses when this file names its address and some process of this host has that GCS
        # address on its command line, as every worker raylet here does (a new head pod starts with an empty /tmp).
        Path(node.temp_dir, "ray_current_cluster").unlink(missing_ok=True)
    joined = json.loads(join_file(plan).read_text())
    start_node(plan, node, {**new_run_env(keep_existing=True), **joined["env"]}, joined["redis_password"])


def _check(argv: list[str], **kwargs) -> None:
    done = _run(argv, cwd=REPO, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def teardown(plan: ClusterPlan, run_id: str | None = None) -> list[str]:
    """End every process of the cluster, then remove its namespaces, veths and bridge; safe to
    repeat, and on a half-built cluster. Returns what is still there (empty: all gone)."""
    for _ in range(3):  # a raylet may restart a worker while the first signals land
        namespaces, _links = present(plan)
        pids = sorted(set(namespace_pids(namespaces)) | set(find_processes(run_id) if run_id else ()))
        if not pids:
            break
        kill(pids)
    namespaces, links = present(plan)
    for argv in plan.teardown_commands(namespaces, links):
        _run(argv)
    for node in plan.nodes:  # its processes are gone: nothing listens on these sockets any more
        shutil.rmtree(node.rpc_dir, ignore_errors=True)
    if plan.redis is not None:
        shutil.rmtree(plan.redis.data_dir, ignore_errors=True)  # its config holds the password
    deadline = time.monotonic() + 20  # the kernel removes a deleted namespace's veths a moment later
    while (found := present(plan)) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.5)
    namespaces, links = found
    left = [f"namespace {ns}" for ns in namespaces] + [f"link {link}" for link in links]
    left += [f"pid {pid}" for pid in (find_processes(run_id) if run_id else ())]
    return left


# --------------------------------------------------------------------------- commands


def up(plan: ClusterPlan, config: str | None) -> int:
    namespaces, links = present(plan)
    if namespaces or links:
        _say(f"a cluster named {plan.prefix!r} is (partly) there: {namespaces + links}; "
             f"`python -m app.tools.cluster down{'' if plan.prefix == DEFAULT_PREFIX else ' --prefix ' + plan.prefix}` first")
        return 2
    if (conflict := host_conflict(plan, host_networks())) is not None:
        _say(f"cannot build the cluster: {conflict}")
        return 2
    env = {**new_run_env(keep_existing=True), **auth_env(secrets.token_hex(32))}
    redis_password = secrets.token_hex(32) if plan.gcs_ft else None
    child: list[subprocess.Popen] = []
    serving: list[bool] = []
    stopping: list[float] = []

    def on_signal(signum, _frame):
        if not serving:  # still building: stop building, tear down
            raise KeyboardInterrupt
        if not stopping:
            stopping.append(time.monotonic())
            _say(f"stopping ({signal.Signals(signum).name})")
        if child and child[0].poll() is None:
            child[0].send_signal(signal.SIGINT)  # app.tools.run stops Serve, then sweeps its run

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    keep = False
    try:
        build(plan, env, redis_password)
        if plan.link is not None:
            _say(f"links of {' and '.join(n.kind.value for n in plan.shaped_nodes)} shaped to {plan.link.mbit:g} Mbit/s "
                 f"each way (tbf; the head's is not)")
        if config is None:
            keep = True
            ray_env = " ".join(f"{k}={v}" for k, v in {"RAY_ADDRESS": plan.gcs_address, **auth_env(env["RAY_AUTH_TOKEN"])}.items())
            _say(f"cluster up (run id {env[MARKER]}). Serve on it from the head's namespace: "
                 f"`ip netns exec {plan.head.namespace} env {ray_env} serve run CONFIG`; "
                 f"`python -m app.tools.cluster down` removes it")
            return 0
        config = str(Path(config).resolve())  # app.tools.run runs in the repo, the user maybe elsewhere
        base = plan.base_url(urlsplit(base_url_of(yaml.safe_load(Path(config).read_text()) or {})).port)
        _say(f"serving {config} on the cluster: {base}/v1 from this host; Ctrl-C stops everything")
        driver_env = {**env, "RAY_ADDRESS": plan.gcs_address}
        if plan.gcs_ft:
            # No driver of ours stays on the head, where a head restart would end it.
            deploy_detached(plan, config, driver_env)
            serving.append(True)
            threading.Thread(target=_say_when_ready, args=(base, lambda: not stopping), daemon=True).start()
            while not stopping:
                time.sleep(0.5)
            code = 0
        else:
            child.append(subprocess.Popen(
                in_namespace(plan.head.namespace, [sys.executable, "-m", "app.tools.run", config]),
                cwd=REPO, env=driver_env,
                start_new_session=True,  # a terminal's Ctrl-C reaches app.tools.run once, through us
            ))
            serving.append(True)
            threading.Thread(target=_say_when_ready, args=(base, lambda: child[0].poll() is None), daemon=True).start()
            code = _wait(child[0], stopping)
    except RuntimeError as e:
        _say(f"cluster start failed: {e}")
        code = 1
    except KeyboardInterrupt:
        _say("interrupted while starting")
        code = 130
    finally:
        if not keep:
            # A second Ctrl-C must not cut the teardown short.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: _say("removing the cluster; a moment"))
            left = teardown(plan, env[MARKER])
            _say("cluster removed; all processes ended" if not left else f"could not remove {left}")
    return 1 if left else code


def deploy_detached(plan: ClusterPlan, config: str, env: dict[str, str], timeout_s: float = 300) -> None:
    """``serve run --non-blocking CONFIG`` from the head's namespace: it starts Serve (the controller and a proxy
    on every node, as the config asks), submits the app and exits; the app then lives on without a driver.
    Ctrl-C of ``up`` removes the whole cluster, app included."""
    argv = in_namespace(plan.head.namespace, [sys.executable, "-m", "ray.serve.scripts", "run", "--non-blocking", config])
    done = _run(argv, cwd=REPO, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"serve run --non-blocking failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")


def _say_when_ready(base: str, alive: Callable[[], bool]) -> None:
    """app.tools.run says when the app is ready at the head's own 127.0.0.1 (nothing does, deployed detached);
    say where this host reaches it."""
    while alive():
        if (read_readiness(f"{base}/ready") or (None, {}))[1].get("ready"):
            _say(f"ready on the cluster: {base}/v1 (from this host)")
            return
        time.sleep(3)


def _wait(child: subprocess.Popen, stopping: list[float]) -> int:
    while True:
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            if stopping and time.monotonic() - stopping[0] > _STOP_GRACE_S:
                return -signal.SIGINT  # teardown ends what is left


def down(plan: ClusterPlan) -> int:
    namespaces, links = present(plan)
    left = teardown(plan)
    if left:
        _say(f"could not remove {left}")
        return 1
    _say(f"removed namespaces {namespaces} and links {links}" if namespaces or links else "nothing to remove: no cluster was there")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m app.tools.cluster",
        description="A head, a prefill and a decode Ray node on this machine, each in its own network namespace "
        "(docs/cluster.md); up: serve CONFIG on them until Ctrl-C; down: remove a cluster left behind.",
    )
    parser.add_argument("command", choices=["up", "down", "kill-node", "rejoin"])
    parser.add_argument("config", nargs="?", default=None,
                        help=f"up: serve config (default {DEFAULT_CONFIG}, with --gcs-ft {DEFAULT_FT_CONFIG}); "
                        "kill-node, rejoin: prefill or decode, or head with GCS fault tolerance")
    parser.add_argument("--no-app", action="store_true", help="up: start the bare cluster and leave it running")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="names of namespaces and links: <prefix>-head, ...")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET, help="private IPv4 network for the bridge and nodes")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="up: shape the prefill and decode nodes' links to this rate, both ways (Linux tbf), so KV "
                        "crosses a link of that rate (docs/cluster.md, 'A shaped link'); default unshaped")
    parser.add_argument("--gcs-ft", action="store_true",
                        help="up: GCS fault tolerance on a Redis of the cluster's own (Debian's redis-server; `make "
                        "redis`), the app deployed without a driver, clients on the decode node's proxy (docs/cluster.md)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        _say("app.tools.cluster needs root (ip netns, veth pairs, a bridge)")
        return 2
    try:
        plan = load_plan(args.prefix, args.subnet, args.link_mbit, args.gcs_ft)
    except ValueError as e:
        _say(f"cannot plan the cluster: {e}")
        return 2
    if args.command != "up":
        plan = running_plan(args.prefix, args.subnet)
    if args.command == "down":
        return down(plan)
    if args.command in ("kill-node", "rejoin"):
        nodes = [k.value for k in NodeKind if k is not NodeKind.HEAD or plan.gcs_ft]
        if args.config not in nodes:
            _say(f"{args.command}: name a node, {' or '.join(nodes)} (not {args.config!r}; the head only with "
                 f"GCS fault tolerance, up --gcs-ft)")
            return 2
        kind = NodeKind(args.config)
        try:
            if args.command == "kill-node":
                _say(f"killed {len(kill_node(plan, kind))} processes of node {kind.value}")
            else:
                rejoin(plan, kind)
        except (RuntimeError, OSError) as e:
            _say(f"{args.command} {kind.value} failed: {e}")
            return 1
        return 0
    if args.no_app:
        return up(plan, None)
    config = args.config or (DEFAULT_FT_CONFIG if args.gcs_ft else DEFAULT_CONFIG)
    if args.gcs_ft and (why := ft_config_problem(config)) is not None:
        _say(f"--gcs-ft: {config}: {why}")
        return 2
    return up(plan, config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
