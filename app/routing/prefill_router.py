"""Serve request router of the prefill deployment: the least prefill work outstanding.

Prefill work is prompt tokens, not requests: one 4k-token prompt keeps a prefill engine
as busy as a hundred short ones. Every decode replica routes its own prefill legs (the
handle lives in its process), so this router combines:

* the prompt tokens of the legs this router sent that have not completed — exact and
  immediate; ``DecodeServer`` writes each leg's prompt length on the request it sends
  (``app.request.envelope.PROMPT_TOKENS``), and text length stands in for a leg without it;
* what each ``PrefillServer`` publishes every ``routing.stats_period_s``: the prompt tokens
  of every router's legs in flight there, seconds late on a busy box.

It also hands on what each prefill replica published of its engine's cost
(``app.request.deadlines.PUBLISHED``, which this decode replica's deadlines read).

The pipeline and its scorers are ``app.routing.pipeline``'s, with ``routing.prefill_policy``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter

from app.request.deadlines import published_prefill_costs
from app.request.envelope import record_prefill_pick
from app.routing.decode_router import count_pick, ranked, snapshot_from_stats
from app.routing.pipeline import PublishedLoad, RouteRequest, RoutingPolicy, pick
from app.routing.sent_tokens import SentTokens, prompt_tokens_of

logger = logging.getLogger("ray.serve." + __name__)

class LoadAwarePrefillRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: dict[str, Any] | None = None) -> None:
        self._policy = RoutingPolicy.model_validate(policy or {})
        self._tokens_sent = SentTokens()  # prompt tokens of the legs sent from here, not completed

    def update_replicas(self, replicas) -> None:
        # Serve calls it with each change of the replicas' published stats, picks or not: a request
        # already waiting (its deadlines re-read the cost) learns of a measurement made meanwhile.
        super().update_replicas(replicas)
        self._publish_costs(replicas)

    @staticmethod
    def _publish_costs(replicas) -> None:
        published = {str(r.replica_id): PublishedLoad.read(r.routing_stats) for r in replicas}
        published_prefill_costs({rid: (load.prefill_cost, load.prefill_cost_fitted)
                                 for rid, load in published.items() if load and load.prefill_cost})

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._tokens_sent.completed(internal_request_id)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        now = time.time()
        by_id = {str(r.replica_id): r for r in candidate_replicas}
        args = getattr(pending_request, "args", None) or ()
        tokens = self._tokens_sent.tokens_for(pending_request, prompt_tokens_of)
        snapshots = [
            snapshot_from_stats(
                rid, self.replica_queue_len_cache.get(r.replica_id), r.routing_stats, now,
                tokens_sent_here=self._tokens_sent[rid],
            )
            for rid, r in by_id.items()
        ]
        decision = pick(self._policy, RouteRequest(prompt_tokens=tokens), snapshots)
        self._tokens_sent.picked(pending_request, decision.replica_id, tokens)
        count_pick("prefill", decision)
        if args and getattr(args[0], "request_id", None):
            ahead = next((s.tokens_in_flight for s in snapshots if s.replica_id == decision.replica_id), 0)
            record_prefill_pick(args[0].request_id, time.time(), ahead)  # the leg's deadline counts the work ahead
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("prefill pick %s for %d tokens, scores=%s", decision.replica_id, tokens, decision.scores)
        return ranked(decision, by_id)
