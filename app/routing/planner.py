"""What a decode replica does with one request, decided from facts alone (pure).

``DecodeServer`` gathers the facts (prompt length, conversation turn, eligibility, late
binding) and carries out the :class:`Plan`; every decision lives here, with
table-driven tests that start nothing (tests/unit/routing/test_planner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from app.request.envelope import Route
from app.routing.conversations import Turn
from connector.params import ReuseReason, ReuseReport, TransferMode


# What became of a conversation turn's history, beyond Turn.reason and ReuseReport.reason.
UNSUPPORTED = ReuseReason.UNSUPPORTED.value  # also pull without read-back: prefill recomputes the history
UNREPORTED = "unreported"  # the prefill leg sent no report


@dataclass(frozen=True)
class PlanSettings:
    mode: TransferMode
    local_prefill_below_tokens: int
    late_binding: bool  # pull: decode picked after prefill, by load
    upstream_history: bool  # pull with vLLM's read-back of a conversation's history
    isolate_uncached: bool  # a request outside a conversation shares no prefix cache


@dataclass(frozen=True)
class RequestFacts:
    request_id: str
    prompt_tokens: int | None  # None: could not tokenize (disaggregated, as if long)
    stream: bool
    turn: Turn | None  # its conversation turn, if any
    alone_reason: str | None = None  # why only decode's engine can serve it (app.routing.eligibility)
    prefilled: bool = False  # late binding: another replica ran its prefill leg
    client_salt: str | None = None  # the client's own cache_salt


@dataclass(frozen=True)
class Plan:
    route: Route  # LOCAL or REMOTE (a handoff may still turn into FALLBACK or HANDED_OFF)
    cache_salt: str | None  # None: leave the request's own
    push_reuse: bool  # push: both legs ask the engines to reuse the history decode holds
    read_back: bool  # pull read-back: the prefill leg READs the history this replica kept
    keep: bool  # pull read-back: decode keeps this turn's blocks for the next turn
    hand_off: bool  # pull late binding: answer with a Prefilled instead of decoding here


def plan(facts: RequestFacts, settings: PlanSettings) -> Plan:
    turn = facts.turn
    salt_basis = turn.cache_salt if turn is not None else facts.request_id if settings.isolate_uncached else None
    prompt_tokens = facts.prompt_tokens if facts.prompt_tokens is not None else settings.local_prefill_below_tokens
    # What would have to be computed: for a conversation turn, beyond the history held here.
    to_compute = prompt_tokens - (turn.held_tokens if turn is not None and turn.reuse else 0)
    local = not facts.prefilled and (facts.alone_reason is not None or to_compute < settings.local_prefill_below_tokens)
    return Plan(
        route=Route.LOCAL if local else Route.REMOTE,
        cache_salt=cache_salt(facts.client_salt, salt_basis) if salt_basis else None,
        push_reuse=turn is not None and turn.reuse and settings.mode is TransferMode.PUSH,
        read_back=turn is not None and settings.upstream_history,
        keep=turn is not None and settings.upstream_history and not facts.stream,
        hand_off=settings.late_binding and turn is None,
    )


def cache_salt(client_salt: str | None, ours: str) -> str:
    """Our prefix-cache salt, kept apart by the client's own (vLLM's ``cache_salt``) if any."""
    return f"{client_salt}|{ours}" if client_salt else ours


def turn_outcome(turn: Turn, route: Route, settings: PlanSettings, report: ReuseReport | None) -> str:
    """What became of a turn's history (the ``history`` label of ``rendezvous_conversation_turns``)."""
    if not turn.reuse:
        return turn.reason.value
    if route is not Route.REMOTE:
        return route.value  # local: decode prefilled it from its own cache; fallback
    if settings.mode is not TransferMode.PUSH and not settings.upstream_history:
        return UNSUPPORTED  # pull: prefill recomputes; decode still reads only the new tail
    return report.reason if report is not None else UNREPORTED
