"""Serve replicas of a running app, for fault injection (the integration tests and ``bench
soak``): which replicas are healthy, their processes, and waiting for Serve to replace the
ones that were killed. Read from Ray's Prometheus export and Ray's log file names."""

from __future__ import annotations

import time

from app.tools.procs import RAY_SESSION
from bench.engine_metrics import scrape


def healthy_replicas(metrics_url: str, deployment: str, timeout_s: float = 60) -> dict[str, str]:
    """Replicas of ``deployment`` Serve's controller reports healthy: replica id -> the id
    of the Ray worker it runs in (from the replica's own start counter, which Ray may
    export a few seconds after the controller's gauge)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(metrics_url, "ray_serve_deployment_replica_")
        healthy = {
            labels["replica"] for name, labels, value in samples
            if name == "ray_serve_deployment_replica_healthy" and labels.get("deployment", "").startswith(deployment)
            and value == 1
        }
        workers = {
            labels["replica"]: labels["WorkerId"] for name, labels, _ in samples
            if name == "ray_serve_deployment_replica_starts_total" and labels.get("replica") in healthy
        }
        if (healthy and workers.keys() == healthy) or time.monotonic() > deadline:
            return workers
        time.sleep(1)


def worker_pid(worker_id: str) -> int:
    """The pid of a Ray worker on this node: Ray names its log files ``worker-<id>-<job>-<pid>``."""
    logs = sorted(RAY_SESSION.glob(f"logs/worker-{worker_id}-*.out"))
    if not logs:
        raise LookupError(f"no log file of Ray worker {worker_id} under {RAY_SESSION}/logs")
    return int(logs[0].stem.rsplit("-", 1)[1])


def wait_replaced(metrics_url: str, deployment: str, gone: set[str], count: int, timeout_s: float = 600) -> set[str]:
    """Wait until ``count`` replicas of ``deployment`` other than ``gone`` are healthy:
    Serve replaced the ones that were killed (an engine starts in a minute or two on CPU)."""
    deadline = time.monotonic() + timeout_s
    while len(healthy := set(healthy_replicas(metrics_url, deployment, timeout_s=10)) - gone) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Serve did not replace {sorted(gone)} of {deployment}: healthy {sorted(healthy)}")
        time.sleep(1)
    return healthy
