"""Serve request router of the decode deployment: the load-aware pick at arrival.

In push mode the decode replica must be chosen the moment a request arrives, before
anything is known about how the prefill will go, so it should be the replica with the
most room now. This router turns each candidate into an ``app.routing.pipeline.ReplicaSnapshot``
from two sources and runs the configured pipeline:

* the requests this router itself sent to each replica and that have not completed, and their
  tokens (prompt and output budget, as the replica counts them; ``app.routing.sent_tokens``) —
  exact and immediate for this ingress replica's own traffic;
* Serve's own probed queue length (fresh to the last probe or routed request; it expires);
* the stats each ``DecodeServer`` publishes through ``record_routing_stats`` every
  ``request_routing_stats_period_s`` (1 s by default here): requests and tokens in flight
  and KV capacity, with the time they were recorded. They reach the router through Serve's
  controller, a few seconds late on a busy box, but they count every router's requests.

Conversation affinity: a request with an ``X-Conversation-Id`` header scores its
conversation's holder highest. Holders are known from what each replica publishes (the
conversations it served most recently, retained or expired — an expired one's next turn
still goes there and is told it expired — so every ingress replica learns them within a
few seconds) and from this router's own recent picks.

It returns the pick first and the others by score, so Serve falls through to the next
best when the pick is at ``max_ongoing_requests``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import Counter, OrderedDict
from typing import Any

from ray.serve._private.request_router.request_router import FIFOMixin, RequestRouter
from ray.serve.metrics import Counter as MetricCounter

from app.request.envelope import DECODE_PICKED_AT, conversation_id_of
from app.routing.pipeline import Decision, PublishedLoad, ReplicaSnapshot, RouteRequest, RoutingPolicy, pick
from app.routing.sent_tokens import SentTokens, decode_tokens_of

logger = logging.getLogger("ray.serve." + __name__)

# This router remembers where it sent a conversation for this long (and this many), until
# the replica's published stats say so too; a stale entry only costs a missed reuse.
_LOCAL_AFFINITY_S = 600.0
_LOCAL_AFFINITY_MAX = 100_000


@functools.cache
def _picks() -> MetricCounter:
    return MetricCounter(
        "rendezvous_routing_picks",
        description="Replicas picked by our request routers, by role (decode, prefill) and why: conversation "
        "(the replica holding the request's conversation), load (the best load score), all_filtered (every replica "
        "was filtered out, e.g. KV full everywhere: picked by load among all), round_robin.",
        tag_keys=("role", "reason"),
    )


def count_pick(role: str, decision: Decision, conversation_holder: bool = False) -> None:
    reason = "all_filtered" if decision.fallback else "conversation" if conversation_holder else "load"
    _picks().inc(tags={"role": role, "reason": reason})


def ranked(decision: Decision, by_id: dict) -> list[list]:
    """The pick first, then the others by score: Serve falls through to the next rank
    when the pick is at ``max_ongoing_requests``."""
    rest = sorted((rid for rid in decision.totals if rid != decision.replica_id), key=lambda rid: -decision.totals[rid])
    return [[by_id[decision.replica_id]]] + ([[by_id[rid] for rid in rest]] if rest else [])


def conversation_of(pending_request) -> str | None:
    """The conversation id of a request to ``DecodeServer.chat/completions(body, raw_request_info)``."""
    args = getattr(pending_request, "args", None) or ()
    return conversation_id_of(args[1]) if len(args) > 1 else None


def _stamp_pick(pending_request) -> None:
    """The request's timeline: when its decode replica was picked (app.request.timeline). Serve sends the
    arguments after the pick; a later pick of the same request replaces it."""
    args = getattr(pending_request, "args", None) or ()
    if args:
        DECODE_PICKED_AT.write(args[0], time.time())


def snapshot_from_stats(
    replica_id: str,
    probed_queue_len: int | None,
    stats: dict[str, Any] | None,
    now: float,
    sent_here: int = 0,
    holds_conversation: bool = False,
    tokens_sent_here: int = 0,
) -> ReplicaSnapshot:
    published = PublishedLoad.read(stats) or PublishedLoad(0, 0, 0.0)
    ongoing = max(sent_here, probed_queue_len or 0, published.ongoing)
    tokens = max(tokens_sent_here, published.tokens_in_flight)
    capacity, recorded = published.kv_capacity_tokens, published.recorded_at
    return ReplicaSnapshot(
        replica_id=replica_id,
        ongoing_requests=ongoing,
        tokens_in_flight=tokens,
        kv_usage=(tokens / capacity) if capacity else None,
        stats_age_s=(now - recorded) if recorded else None,
        holds_conversation=holds_conversation,
    )


class LoadAwareDecodeRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: dict[str, Any] | None = None) -> None:
        self._policy = RoutingPolicy.model_validate(policy or {})
        self._sent_here: Counter = Counter()  # ReplicaID -> requests sent by this router, not completed
        self._tokens_sent = SentTokens()  # ... and their tokens, by replica id: the published ones come late
        self._picked: OrderedDict[str, tuple[str, float]] = OrderedDict()  # conversation -> (replica, when)
        self._published: dict[str, tuple[Any, frozenset]] = {}  # replica -> (recorded_at, conversations)

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self._sent_here[replica_id] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        if self._sent_here[replica_id] > 1:
            self._sent_here[replica_id] -= 1
        else:
            self._sent_here.pop(replica_id, None)
        self._tokens_sent.completed(internal_request_id)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        now = time.time()
        by_id = {str(r.replica_id): r for r in candidate_replicas}
        conversation = conversation_of(pending_request)
        holders = self._holders(conversation, by_id, now) if conversation else set()
        snapshots = [
            snapshot_from_stats(
                rid, self.replica_queue_len_cache.get(r.replica_id), r.routing_stats, now, self._sent_here[r.replica_id],
                holds_conversation=rid in holders, tokens_sent_here=self._tokens_sent[rid],
            )
            for rid, r in by_id.items()
        ]
        decision = pick(self._policy, RouteRequest(conversation_id=conversation), snapshots)
        tokens = self._tokens_sent.tokens_for(pending_request, decode_tokens_of)
        self._tokens_sent.picked(pending_request, decision.replica_id, tokens)
        count_pick("decode", decision, conversation_holder=decision.replica_id in holders)
        _stamp_pick(pending_request)
        if conversation:
            self._picked[conversation] = (decision.replica_id, now)
            self._picked.move_to_end(conversation)
            if len(self._picked) > _LOCAL_AFFINITY_MAX:
                self._picked.popitem(last=False)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "decode pick %s scores=%s filtered=%s fallback=%s",
                decision.replica_id, decision.scores, decision.filtered_out, decision.fallback,
            )
        return ranked(decision, by_id)

    def _holders(self, conversation: str, by_id: dict, now: float) -> set[str]:
        holders = set()
        for rid, replica in by_id.items():
            published = PublishedLoad.read(replica.routing_stats)
            recorded = published.recorded_at if published else None
            cached = self._published.get(rid)
            if cached is None or cached[0] != recorded:
                cached = (recorded, frozenset(published.conversations if published else ()))
                self._published[rid] = cached
            if conversation in cached[1]:
                holders.add(rid)
        picked = self._picked.get(conversation)
        if picked is not None and now - picked[1] < _LOCAL_AFFINITY_S and picked[0] in by_id:
            holders.add(picked[0])
        return holders


class RoundRobinDecodeRouter(FIFOMixin, RequestRouter):
    """The baseline ``bench skew`` compares against: each request to the next replica in
    turn, blind to load and to conversations (``routing.decode_router: round_robin``)."""

    def initialize_state(self, **_: Any) -> None:
        self._turn = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: str(r.replica_id))
        first = self._turn % len(ordered)
        self._turn += 1
        _picks().inc(tags={"role": "decode", "reason": "round_robin"})
        _stamp_pick(pending_request)
        rest = ordered[first + 1:] + ordered[:first]
        return [[ordered[first]]] + ([rest] if rest else [])
