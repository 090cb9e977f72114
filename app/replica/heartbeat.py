"""Every replica of ours (ingress, decode, prefill) keeps a gauge of its own clock: ``rendezvous_replica_heartbeat_seconds``.

Ray exports a process's metrics all at once, every export interval. So ``time() - heartbeat`` tells an operator how
fresh a replica's metrics are (the dashboard's "Metrics age per replica"); one that stops advancing while the replica
exists means its metrics stopped (docs/runbook.md, "Alerts").

A daemon thread sets it, so it advances while the replica's event loop is busy: it tracks the export, not the loop
(Serve's health check watches the loop).
"""

from __future__ import annotations

import functools
import threading
import time

from ray.serve.metrics import Gauge

HEARTBEAT_METRIC = "rendezvous_replica_heartbeat_seconds"
# A heartbeat in an export is at most this old.
BEAT_S = 0.25


@functools.cache
def start() -> threading.Thread:
    """Start this process's heartbeat (once a process: later calls return the running one)."""
    gauge = Gauge(HEARTBEAT_METRIC, description=f"Unix time by this replica's clock, set every {BEAT_S} s: how fresh its "
                  "other metrics are (Ray exports a replica's metrics together). Stops advancing if its metrics stop.")

    def beat() -> None:
        while True:
            gauge.set(time.time())
            time.sleep(BEAT_S)

    thread = threading.Thread(target=beat, name="rendezvous-heartbeat", daemon=True)
    thread.start()
    return thread
