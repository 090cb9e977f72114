"""Choosing a replica: filter → score → pick, over a snapshot of replica state (pure).

Every scorer returns a value in [0, 1] (1 = best) and is weighted from config; a
replica's score is the weighted mean. Filters drop replicas that must not be chosen;
when every replica is filtered out the pick falls back to all candidates rather than
failing (Serve's own back-pressure — ``max_ongoing_requests`` — still applies). Each
decision records what every filter and scorer did, for debug logs and metrics.

The Ray side (``app.routing.decode_router``) builds the snapshots from Serve's probed queue
lengths and the stats each replica publishes (``record_routing_stats``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.routing.admission import Line

# Under this key of a replica's routing stats: its PublishedLoad.
STATS_KEY = "rendezvous"


@dataclass(frozen=True)
class PublishedLoad:
    """What a prefill or decode replica publishes for the routers every stats period
    (Serve's ``record_routing_stats``; the routers read it as ``routing_stats``)."""

    ongoing: int  # requests (or prefill legs) in flight
    tokens_in_flight: int  # decode: prompt + remaining output tokens; prefill: prompt tokens
    recorded_at: float  # wall clock
    kv_capacity_tokens: int | None = None  # decode
    conversations: tuple[str, ...] = ()  # decode: the most recently served, retained or expired
    prefill_cost: Line | None = None  # prefill: seconds its engine computes n prompt tokens alone (app.request.deadlines)
    prefill_cost_fitted: bool = False  # ... a least-squares fit, not a few legs' seconds per token

    def publish_into(self, stats: dict) -> dict:
        cost = self.prefill_cost
        stats[STATS_KEY] = {
            "ongoing": self.ongoing, "tokens_in_flight": self.tokens_in_flight, "recorded_at": self.recorded_at,
            "kv_capacity_tokens": self.kv_capacity_tokens, "conversations": list(self.conversations),
            "prefill_cost": None if cost is None else {"base_s": cost.base_s, "s_per_token": cost.slope,
                                                       "fitted": self.prefill_cost_fitted},
        }
        return stats

    @classmethod
    def read(cls, routing_stats: Mapping | None) -> PublishedLoad | None:
        raw = (routing_stats or {}).get(STATS_KEY)
        if not isinstance(raw, Mapping):
            return None
        capacity, cost = raw.get("kv_capacity_tokens"), raw.get("prefill_cost")
        return cls(
            ongoing=int(raw.get("ongoing") or 0),
            tokens_in_flight=int(raw.get("tokens_in_flight") or 0),
            recorded_at=float(raw.get("recorded_at") or 0.0),
            kv_capacity_tokens=int(capacity) if capacity else None,
            conversations=tuple(raw.get("conversations") or ()),
            prefill_cost=_line(cost),
            prefill_cost_fitted=isinstance(cost, Mapping) and cost.get("fitted") is True,
        )


def _line(raw) -> Line | None:
    """A published cost line, if it is one (another build may publish none)."""
    try:
        line = Line(float(raw["base_s"]), float(raw["s_per_token"]))
    except (TypeError, KeyError, ValueError):
        return None
    return line if line.base_s >= 0 and line.slope > 0 else None


@dataclass(frozen=True)
class ReplicaSnapshot:
    replica_id: str
    ongoing_requests: int = 0
    # Prompt + remaining output tokens of the requests in flight (our accounting).
    tokens_in_flight: int = 0
    # Fraction of the engine's KV cache in use, if the replica has reported it.
    kv_usage: float | None = None
    healthy: bool = True
    # Seconds since the replica's stats were recorded; None = never reported.
    stats_age_s: float | None = None
    # It retains the KV of the request's conversation.
    holds_conversation: bool = False


@dataclass(frozen=True)
class RouteRequest:
    prompt_tokens: int = 0
    max_tokens: int = 0
    conversation_id: str | None = None


@dataclass(frozen=True)
class Decision:
    replica_id: str
    scores: Mapping[str, Mapping[str, float]]  # replica → scorer → score
    totals: Mapping[str, float]  # replica → weighted score
    filtered_out: Mapping[str, str] = field(default_factory=dict)  # replica → filter
    fallback: bool = False  # every replica was filtered out


Filter = Callable[[RouteRequest, ReplicaSnapshot, "RoutingPolicy"], bool]
Scorer = Callable[[RouteRequest, ReplicaSnapshot, Sequence[ReplicaSnapshot]], float]


def _healthy(req: RouteRequest, r: ReplicaSnapshot, policy: "RoutingPolicy") -> bool:
    return r.healthy


def _kv_room(req: RouteRequest, r: ReplicaSnapshot, policy: "RoutingPolicy") -> bool:
    # Unknown or stale usage never excludes a replica: stale data must not starve one.
    if r.kv_usage is None or not _fresh(r, policy):
        return True
    return r.kv_usage < policy.max_kv_usage


def _least_ongoing(req: RouteRequest, r: ReplicaSnapshot, peers: Sequence[ReplicaSnapshot]) -> float:
    most = max(p.ongoing_requests for p in peers)
    return 1.0 if most == 0 else 1.0 - r.ongoing_requests / most


def _least_tokens(req: RouteRequest, r: ReplicaSnapshot, peers: Sequence[ReplicaSnapshot]) -> float:
    most = max(p.tokens_in_flight for p in peers)
    return 1.0 if most == 0 else 1.0 - r.tokens_in_flight / most


def _kv_free(req: RouteRequest, r: ReplicaSnapshot, peers: Sequence[ReplicaSnapshot]) -> float:
    return 0.5 if r.kv_usage is None else max(0.0, min(1.0, 1.0 - r.kv_usage))


def _conversation(req: RouteRequest, r: ReplicaSnapshot, peers: Sequence[ReplicaSnapshot]) -> float:
    return 1.0 if req.conversation_id and r.holds_conversation else 0.0


FILTERS: dict[str, Filter] = {"healthy": _healthy, "kv_room": _kv_room}
SCORERS: dict[str, Scorer] = {
    "least_ongoing": _least_ongoing,
    "least_tokens": _least_tokens,
    "kv_free": _kv_free,
    "conversation": _conversation,
}


def _fresh(r: ReplicaSnapshot, policy: "RoutingPolicy") -> bool:
    return r.stats_age_s is not None and r.stats_age_s <= policy.max_stats_age_s


class RoutingPolicy(BaseModel):
    """How a replica is picked: the decode replica when a request arrives (or, in pull mode with late binding,
    when its prefill is done), the prefill replica for each prefill leg."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    filters: list[str] = Field(["healthy", "kv_room"], description=f"Filters, in order; known: {sorted(FILTERS)}.")
    scorers: dict[str, float] = Field(
        {"least_ongoing": 1.0, "least_tokens": 1.0, "kv_free": 0.5, "conversation": 4.0},
        description=f"Scorer name → weight; known: {sorted(SCORERS)}. `conversation` (1 for the replica holding the "
        "request's conversation) outweighs the load scorers together by default: a turn goes where its history is "
        "unless a filter excludes that replica.",
    )
    max_kv_usage: float = Field(0.95, gt=0, le=1, description="kv_room filter: skip replicas whose KV use is above this.")
    max_stats_age_s: float = Field(10.0, gt=0, description="Engine stats older than this are ignored by filters.")

    @field_validator("filters")
    @classmethod
    def _known_filters(cls, names: list[str]) -> list[str]:
        unknown = sorted(set(names) - FILTERS.keys())
        if unknown:
            raise ValueError(f"unknown filter(s) {unknown}; known: {sorted(FILTERS)}")
        return names

    @field_validator("scorers")
    @classmethod
    def _known_scorers(cls, weights: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(weights) - SCORERS.keys())
        if unknown:
            raise ValueError(f"unknown scorer(s) {unknown}; known: {sorted(SCORERS)}")
        if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
            raise ValueError("scorer weights must be >= 0 with at least one > 0")
        return weights


def pick(
    policy: RoutingPolicy,
    request: RouteRequest,
    replicas: Sequence[ReplicaSnapshot],
    rng: random.Random | None = None,
) -> Decision:
    """Filter, score and pick one replica; ties are broken at random."""
    if not replicas:
        raise ValueError("no replicas to choose from")
    filtered_out: dict[str, str] = {}
    candidates = list(replicas)
    for name in policy.filters:
        keep = [r for r in candidates if FILTERS[name](request, r, policy)]
        for r in candidates:
            if r not in keep:
                filtered_out[r.replica_id] = name
        candidates = keep
    fallback = not candidates
    if fallback:
        candidates = list(replicas)

    total_weight = sum(policy.scorers.values())
    scores: dict[str, dict[str, float]] = {}
    totals: dict[str, float] = {}
    for r in candidates:
        per = {name: SCORERS[name](request, r, candidates) for name in policy.scorers}
        scores[r.replica_id] = per
        totals[r.replica_id] = sum(policy.scorers[n] * s for n, s in per.items()) / total_weight
    best = max(totals.values())
    tied = sorted(rid for rid, total in totals.items() if best - total < 1e-9)
    chosen = (rng or random).choice(tied)
    return Decision(replica_id=chosen, scores=scores, totals=totals, filtered_out=filtered_out, fallback=fallback)
