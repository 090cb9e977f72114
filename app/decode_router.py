"""Serve request router of the decode deployment: the load-aware pick at arrival.

In push mode the decode replica must be chosen the moment a request arrives, before
anything is known about how the prefill will go, so it should be the replica with the
most room now. This router turns each candidate into an ``app.routing.ReplicaSnapshot``
from two sources and runs the configured pipeline:

* the requests this router itself sent to each replica and that have not completed —
  exact and immediate for this ingress replica's own traffic;
* Serve's own probed queue length (fresh to the last probe or routed request; it expires);
* the stats each ``DecodeServer`` publishes through ``record_routing_stats`` every
  ``request_routing_stats_period_s`` (1 s by default here): requests and tokens in flight
  and KV capacity, with the time they were recorded. They reach the router through Serve's
  controller, a few seconds late on a busy box, but they count every router's requests.

It returns the pick first and the others by score, so Serve falls through to the next
best when the pick is at ``max_ongoing_requests``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from app.routing import ReplicaSnapshot, RouteRequest, RoutingPolicy, pick

logger = logging.getLogger("rendezvous.routing")

STATS_KEY = "rendezvous"


def snapshot_from_stats(
    replica_id: str, probed_queue_len: int | None, stats: dict[str, Any] | None, now: float, sent_here: int = 0
) -> ReplicaSnapshot:
    ours = (stats or {}).get(STATS_KEY) or {}
    ongoing = max(sent_here, probed_queue_len or 0, int(ours.get("ongoing", 0)))
    tokens = int(ours.get("tokens_in_flight", 0))
    capacity = ours.get("kv_capacity_tokens")
    recorded = ours.get("recorded_at")
    return ReplicaSnapshot(
        replica_id=replica_id,
        ongoing_requests=ongoing,
        tokens_in_flight=tokens,
        kv_usage=(tokens / capacity) if capacity else None,
        stats_age_s=(now - recorded) if recorded else None,
    )


class LoadAwareDecodeRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: dict[str, Any] | None = None) -> None:
        self._policy = RoutingPolicy.model_validate(policy or {})
        self._sent_here: Counter = Counter()  # ReplicaID -> requests sent by this router, not completed

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self._sent_here[replica_id] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._sent_here[replica_id] > 1:
            self._sent_here[replica_id] -= 1
        else:
            self._sent_here.pop(replica_id, None)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        now = time.time()
        by_id = {str(r.replica_id): r for r in candidate_replicas}
        snapshots = [
            snapshot_from_stats(
                rid, self._replica_queue_len_cache.get(r.replica_id), r.routing_stats, now, self._sent_here[r.replica_id]
            )
            for rid, r in by_id.items()
        ]
        decision = pick(self._policy, RouteRequest(), snapshots)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "decode pick %s scores=%s filtered=%s fallback=%s",
                decision.replica_id, decision.scores, decision.filtered_out, decision.fallback,
            )
        rest = sorted((rid for rid in decision.totals if rid != decision.replica_id), key=lambda rid: -decision.totals[rid])
        ranks = [[by_id[decision.replica_id]]]
        if rest:
            ranks.append([by_id[rid] for rid in rest])
        return ranks
