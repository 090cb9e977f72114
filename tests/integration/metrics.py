"""Read vLLM's engine metrics (exported through Ray) per role: prefill or decode."""

from __future__ import annotations

import re
import time
from collections import defaultdict

import httpx

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} ([-+0-9.eE]+|NaN|[+-]Inf)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in httpx.get(url, timeout=10).text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            samples.append((m.group(1), dict(_LABEL.findall(m.group(2))), float(m.group(3))))
    return samples


class RoleMetrics:
    """Totals of ``ray_vllm_*`` samples by role, keyed by replica via Serve's own metrics."""

    def __init__(self, url: str):
        self.url = url

    def snapshot(self) -> dict[str, dict[str, float]]:
        samples = scrape(self.url)
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
                if "le" in labels:
                    key += f"[le={labels['le']}]"
                totals[role][key] += value
                totals[f"replica:{labels['ReplicaId']}"][key] += value
        return {role: dict(values) for role, values in totals.items()}

    def settled_snapshot(self, quiet_s: float = 12.0, timeout_s: float = 90.0) -> dict[str, dict[str, float]]:
        """A snapshot that stopped changing for ``quiet_s``: Ray exports engine metrics
        every few seconds, so a fresh scrape can still lack the last requests."""
        deadline = time.monotonic() + timeout_s
        snap, since = self.snapshot(), time.monotonic()
        while time.monotonic() - since < quiet_s:
            if time.monotonic() > deadline:
                raise TimeoutError("engine metrics kept changing; is something else sending requests?")
            time.sleep(2)
            current = self.snapshot()
            if current != snap:
                snap, since = current, time.monotonic()
        return snap

    def wait_for(self, predicate, timeout_s: float = 60, poll_s: float = 1.0):
        """Poll until ``predicate(snapshot)`` is true (Ray exports metrics every few seconds)."""
        deadline = time.monotonic() + timeout_s
        snap = self.snapshot()
        while not predicate(snap):
            if time.monotonic() > deadline:
                raise TimeoutError(f"metrics never satisfied the condition; last snapshot: {snap}")
            time.sleep(poll_s)
            snap = self.snapshot()
        return snap


def delta(after: dict, before: dict, role: str, key: str) -> float:
    return after.get(role, {}).get(key, 0.0) - before.get(role, {}).get(key, 0.0)
