"""Read vLLM's engine metrics (exported through Ray's Prometheus endpoint) per role.

Ray's export names vLLM's metrics ``ray_vllm_*`` and labels each sample with the Serve
replica; Serve's own ``ray_serve_*`` samples map that replica to its deployment, whose
name gives the role (``Prefill:…`` → ``prefill``, ``Decode:…`` → ``decode``, a plain
Ray Serve LLM app's ``LLMServer:…`` → ``llmserver``).

Caveat: Ray exports a histogram's ``_sum`` from bucket midpoints, so sums (bytes moved,
seconds spent) are estimates; ``_count``, ``_bucket`` and counters are exact. The
helpers below therefore derive totals from bucket counts and say which bounds they used.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from app.tools.metrics_text import metric_lines

Snapshot = dict[str, dict[str, float]]
Sample = tuple[str, dict[str, str], float]
T = TypeVar("T")


def parse(text: str) -> list[Sample]:
    """The labelled samples of a Prometheus text exposition, in order: (sample name, labels,
    value as a float), parsed by prometheus_client (which Ray exports with). Names are the
    samples' own (``…_total``, ``…_bucket``, ``…_sum``, ``…_count``); label values are unescaped.
    Samples without labels are left out: Ray labels every sample of its own and the engines'."""
    return [
        (sample.name, sample.labels, float(sample.value))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels
    ]


def scrape(url: str, *names: str) -> list[Sample]:
    """The endpoint's samples; with ``names``, only those whose name starts with one of them (their lines picked
    out before parsing: app.tools.metrics_text)."""
    return parse(metric_lines(url, *names))


def samples_named(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of exactly ``name`` (``scrape`` matches a prefix: a counter's ``_created``
    samples and longer names share it)."""
    return [(labels, value) for sample, labels, value in scrape(url, name) if sample == name]


# Ray exports metrics every ``metrics_report_interval_ms``: 10 s unless the environment Ray starts
# in says otherwise (the integration tests' apps export every second). A fresh scrape can lack what
# happened since the last export; a value unchanged for one export and a margin has settled.
EXPORT_INTERVAL_ENV = "RAY_metrics_report_interval_ms"
# Ray drops a gauge not set again within two export intervals (its metrics agent's
# ``_resolve_gauge_ttl_seconds``), and Serve sets its unchanged status gauges (replica healthy, which the
# missing-replica alerts read) only every ``RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S`` (10 s): with an
# export interval under 5 s, that one must be shorter too, or healthy replicas flicker out of the metrics.
SERVE_STATUS_GAUGE_ENV = "RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S"


def export_interval_s() -> float:
    """Ray's metrics export interval for apps started from this environment (Ray floors it at 1 s)."""
    return max(int(os.environ.get(EXPORT_INTERVAL_ENV, "10000")), 1000) / 1000


def settle_quiet_s() -> float:
    """How long metrics must stay unchanged to count as settled: one export interval and a margin for the
    metrics agent, which records an export as it arrives (2 s: it is rarely busy when a test waits)."""
    return export_interval_s() + 2.0


# Seconds this process has spent in settle() and wait_for(): the suite's time report shows what waiting
# for Ray's metric exports costs each module (tests/support/module_times.py).
waited_s = 0.0


def settle(
    read: Callable[[], T],
    *,
    quiet_s: float | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None,
    on_timeout: Literal["raise", "return"] = "raise",
    what: str = "metrics",
) -> T:
    """``read()`` once it stopped changing for ``quiet_s`` (default ``settle_quiet_s()``; polled every
    ``poll_s``): Ray exports metrics every few seconds, so a fresh scrape can still lack the last requests.

    Past ``timeout_s`` (None: no limit) it raises TimeoutError, or with ``on_timeout="return"``
    returns the latest value."""
    if on_timeout not in ("raise", "return"):
        raise ValueError(f"on_timeout must be 'raise' or 'return', not {on_timeout!r}")
    quiet_s = settle_quiet_s() if quiet_s is None else quiet_s
    started = time.monotonic()
    deadline = None if timeout_s is None else started + timeout_s
    value, since = read(), time.monotonic()
    try:
        while time.monotonic() - since < quiet_s:
            if deadline is not None and time.monotonic() > deadline:
                if on_timeout == "return":
                    return value
                raise TimeoutError(f"{what} kept changing; is something else sending requests?")
            time.sleep(poll_s)
            latest = read()
            if latest != value:
                value, since = latest, time.monotonic()
        return value
    finally:
        _waited(started)


def _waited(started: float) -> None:
    global waited_s
    waited_s += time.monotonic() - started


def counted_by(url: str, name: str, label: str) -> Counter:
    """Samples of the metric ``name`` summed by the value of one ``label`` (over replicas)."""
    counts: Counter = Counter()
    for labels, value in samples_named(url, name):
        counts[labels.get(label, "")] += value
    return counts


class RoleMetrics:
    """Totals of ``ray_vllm_*`` samples by role, keyed by replica via Serve's own metrics.

    ``url`` is one Prometheus endpoint, or several (one per Ray node of a cluster): their
    samples are merged before replicas are mapped to roles.
    """

    def __init__(self, url: str | Iterable[str]):
        self.urls = [url] if isinstance(url, str) else list(url)

    @property
    def url(self) -> str:
        return self.urls[0]

    def snapshot(self, *keys: str) -> Snapshot:
        """Every ``ray_vllm_`` sample by role and by replica; with ``keys``, only those metrics (names without the
        prefix), read a few times a second by a test watching the engines, and mapped to roles by Serve's replica
        metrics alone."""
        names = ("ray_serve_replica_", "ray_serve_deployment_replica_", *("ray_vllm_" + k for k in keys)) if keys else (
            "ray_serve_", "ray_vllm_")
        samples = [s for url in self.urls for s in scrape(url, *names)]
        role_of = {
            labels["replica"]: labels["deployment"].split(":")[0].lower()
            for name, labels, _ in samples
            if name.startswith("ray_serve_") and "replica" in labels and "deployment" in labels
        }
        totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for name, labels, value in samples:
            if name.startswith("ray_vllm_") and "ReplicaId" in labels:
                role = role_of.get(labels["ReplicaId"], "unknown")
                key = name.removeprefix("ray_vllm_")
                for label in ("le", "source"):  # a histogram's bucket; where prompt tokens came from
                    if label in labels:
                        key += f"[{label}={labels[label]}]"
                totals[role][key] += value
                totals[f"replica:{labels['ReplicaId']}"][key] += value
        return {role: dict(values) for role, values in totals.items()}

    def settled_snapshot(self, quiet_s: float | None = None, timeout_s: float = 90.0) -> Snapshot:
        """A snapshot that stopped changing for ``quiet_s`` (default ``settle_quiet_s()``): Ray
        exports engine metrics every few seconds, so a fresh scrape can still lack the last requests."""
        return settle(self.snapshot, quiet_s=quiet_s, timeout_s=timeout_s, what="engine metrics")

    def wait_for(self, predicate, timeout_s: float = 60, poll_s: float = 1.0) -> Snapshot:
        """Poll until ``predicate(snapshot)`` is true (Ray exports metrics every few seconds)."""
        started = time.monotonic()
        deadline = started + timeout_s
        snap = self.snapshot()
        try:
            while not predicate(snap):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"metrics never satisfied the condition; last snapshot: {snap}")
                time.sleep(poll_s)
                snap = self.snapshot()
            return snap
        finally:
            _waited(started)


def delta(after: dict, before: dict, role: str, key: str) -> float:
    return after.get(role, {}).get(key, 0.0) - before.get(role, {}).get(key, 0.0)


# --------------------------------------------------------------------------- all roles, histograms


def roles(snapshot: Snapshot) -> list[str]:
    """The role entries of a snapshot (not the per-replica ones), so each sample counts once."""
    return [r for r in snapshot if not r.startswith("replica:")]


def total_delta(after: Snapshot, before: Snapshot, *keys: str) -> float:
    """``after - before`` of ``keys`` summed over every role (alternative spellings of one
    metric, e.g. a counter with and without Ray's ``_total`` suffix, may be passed together)."""
    names = set(roles(after)) | set(roles(before))
    return sum(delta(after, before, role, key) for role in names for key in keys)


@dataclass(frozen=True)
class HistogramEstimate:
    """What bucket counts say about the observations between two snapshots.

    ``low``/``high`` bound the sum (each observation at its bucket's lower/upper edge;
    ``high`` is None if any landed above the last finite bound); ``mid`` puts each at
    its bucket's midpoint, as Ray's exported ``_sum`` does.
    """

    count: int
    low: float
    mid: float
    high: float | None

    @property
    def mean(self) -> float | None:
        return self.mid / self.count if self.count else None


def histogram_estimate(after: Snapshot, before: Snapshot, metric: str) -> HistogramEstimate:
    """Bucket-derived totals of histogram ``metric`` (e.g. ``nixl_bytes_transferred``) over all roles."""
    prefix = f"{metric}_bucket[le="
    keys = {key for snap in (after, before) for role in roles(snap) for key in snap[role] if key.startswith(prefix)}
    buckets = sorted((_le(key), total_delta(after, before, key)) for key in keys)  # cumulative counts
    count = low = mid = 0.0
    high: float | None = 0.0
    lower_edge, previous_cum = 0.0, 0.0
    for le, cum in buckets:
        n = max(cum - previous_cum, 0.0)
        previous_cum = max(cum, previous_cum)
        if n:
            count += n
            low += n * lower_edge
            if math.isinf(le):  # above the last finite bound: no upper edge, midpoint unknown
                mid += n * lower_edge
                high = None
            else:
                mid += n * (lower_edge + le) / 2
                high = None if high is None else high + n * le
        if not math.isinf(le):
            lower_edge = le
    return HistogramEstimate(count=int(round(count)), low=low, mid=mid, high=high)


def _le(key: str) -> float:
    return float(key.split("le=", 1)[1].rstrip("]"))
