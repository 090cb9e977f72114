"""Admission by expected time to first byte (pure: no Ray, no HTTP; one per ingress replica).

A fixed count of requests in flight cannot be right: whether 48 in flight means 2 s or
5 minutes of waiting depends on prompt and output lengths, mode, hardware and replica
count. What a client sees is its time to first byte (TTFB: a stream's first token, a
whole answer otherwise), so each ingress replica models it from what it has seen:

    TTFB ~ base_s + s_per_kib * (KiB of request bodies admitted here and not yet answered,
                                 the new request's own included)

fitted by least squares over the last ``WINDOW`` answers (each: the work ahead of it when it
was admitted, and the TTFB it got). Work is counted in body bytes, which the ingress has
before it reads the body (Content-Length): it does not tokenize, and bytes per token is
steady within a workload. The fit absorbs that ratio, the prefill rate, the decode load
and the other ingress replicas (each sees only its own arrivals and learns its share of
the rate). A request whose estimate exceeds the SLO gets 429 with a Retry-After of the
time until the work ahead would fit; a request that finds fewer than ``ALWAYS_ADMITTED`` in
flight is admitted whatever the estimate (waiting cannot make it faster, and a model
still full of a past fault must not refuse light traffic).

Before ``MIN_SAMPLES`` answers there is no estimate, and an AIMD limit on requests in flight
decides instead: +1/limit per answer within the SLO, x``BACKOFF`` per answer beyond it (at
most once per ``COOLDOWN_S``), starting at ``max_in_flight`` (no evidence, no cut). It keeps
learning afterwards. ``max_in_flight`` stays a hard ceiling either way; without an SLO it
is the only rule.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

WINDOW = 64  # answers the fit remembers: a few seconds of traffic on a GPU, minutes on the CPU box
MIN_SAMPLES = 8
MIN_SPREAD = 0.25  # work-ahead range / mean below which a slope is noise: TTFB taken as proportional
ALWAYS_ADMITTED = 2
BACKOFF = 0.75
COOLDOWN_S = 1.0
MAX_RETRY_AFTER_S = 60


class Verdict(str, Enum):
    """Why a request was admitted or turned away (the ``reason`` label of the ingress metrics)."""

    IDLE = "idle"  # admitted: fewer than ALWAYS_ADMITTED in flight
    ESTIMATE = "estimate"  # admitted: estimated TTFB within the SLO
    LIMIT = "limit"  # no estimate yet: under (admitted) or at (rejected) the adaptive limit
    UNLIMITED = "unlimited"  # admitted: no SLO configured, below the ceiling
    OVER_SLO = "over_slo"  # rejected: estimated TTFB beyond the SLO
    BUSY = "busy"  # rejected: max_in_flight reached


@dataclass(frozen=True)
class Decision:
    admitted: bool
    verdict: Verdict
    estimate_s: float | None  # the TTFB this request was expected to see, when there was a model
    retry_after_s: int  # for a rejection


@dataclass(frozen=True)
class Ticket:
    """One admitted request, until it leaves."""

    kib: float
    ahead_kib: float  # work ahead of it when admitted, its own included
    admitted_at: float


@dataclass(frozen=True)
class TtfbModel:
    base_s: float
    s_per_kib: float

    def estimate(self, ahead_kib: float) -> float:
        return self.base_s + self.s_per_kib * ahead_kib


def fit(samples: list[tuple[float, float]]) -> TtfbModel | None:
    """Least squares over (work ahead KiB, TTFB s); None below ``MIN_SAMPLES``. With too little
    spread in the work ahead, or a slope that is not positive, TTFB is taken as proportional."""
    if len(samples) < MIN_SAMPLES:
        return None
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    if mean_x <= 0:
        return TtfbModel(mean_y, 0.0)
    spread = max(x for x, _ in samples) - min(x for x, _ in samples)
    if spread >= MIN_SPREAD * mean_x:
        var = sum((x - mean_x) ** 2 for x, _ in samples)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var
        base = mean_y - slope * mean_x
        if slope > 0 and base >= 0:
            return TtfbModel(base, slope)
    return TtfbModel(0.0, mean_y / mean_x)


@dataclass
class AimdLimit:
    """Requests in flight allowed while there is no estimate; learns from every answer."""

    ceiling: int
    value: float = 0.0  # 0: start at the ceiling
    _last_cut: float = field(default=-math.inf, repr=False)

    def __post_init__(self) -> None:
        self.value = float(min(self.value or self.ceiling, self.ceiling))

    def observe(self, ttfb_s: float, slo_s: float, now: float) -> None:
        if ttfb_s <= slo_s:
            self.value = min(float(self.ceiling), self.value + 1.0 / self.value)
        elif now - self._last_cut >= COOLDOWN_S:
            self.value, self._last_cut = max(1.0, self.value * BACKOFF), now

    def allows(self, in_flight: int) -> bool:
        return in_flight < int(self.value)


class Admission:
    """Generation requests of one ingress replica: admit, answer, leave. One event loop runs
    the ingress, so plain counting is safe."""

    def __init__(self, max_in_flight: int, ttft_slo_s: float | None = None, retry_after_s: int = 1):
        self.max_in_flight, self.ttft_slo_s, self.retry_after_s = max_in_flight, ttft_slo_s, retry_after_s
        self.limit = AimdLimit(max_in_flight)
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._model: TtfbModel | None = None
        self._waiting_kib = 0.0  # admitted, not yet answered
        self._waiting: set[int] = set()  # id() of their tickets
        self.in_flight = 0
        self.last_estimate_s: float | None = None

    @property
    def model(self) -> TtfbModel | None:
        return self._model

    def try_enter(self, body_bytes: int, now: float) -> tuple[Decision, Ticket | None]:
        kib = max(body_bytes, 1) / 1024
        ahead = self._waiting_kib + kib
        estimate = self._model.estimate(ahead) if self._model is not None and self.ttft_slo_s is not None else None
        self.last_estimate_s = estimate
        if self.in_flight >= self.max_in_flight:
            return Decision(False, Verdict.BUSY, estimate, self.retry_after_s), None
        if self.ttft_slo_s is None:
            verdict = Verdict.UNLIMITED
        elif self.in_flight < ALWAYS_ADMITTED:
            verdict = Verdict.IDLE
        elif estimate is not None:
            if estimate > self.ttft_slo_s:
                wait = min(MAX_RETRY_AFTER_S, max(self.retry_after_s, math.ceil(estimate - self.ttft_slo_s)))
                return Decision(False, Verdict.OVER_SLO, estimate, wait), None
            verdict = Verdict.ESTIMATE
        elif self.limit.allows(self.in_flight):
            verdict = Verdict.LIMIT
        else:
            return Decision(False, Verdict.LIMIT, None, self.retry_after_s), None
        ticket = Ticket(kib, ahead, now)
        self.in_flight += 1
        self._waiting.add(id(ticket))
        self._waiting_kib += kib
        return Decision(True, verdict, estimate, 0), ticket

    def answered(self, ticket: Ticket, now: float) -> None:
        """Its first byte is out (or it was given up on at the queue deadline: the TTFB it would
        have had is at least that). Once per ticket; later calls do nothing."""
        if not self._stop_waiting(ticket):
            return
        ttfb = now - ticket.admitted_at
        self._samples.append((ticket.ahead_kib, ttfb))
        self._model = fit(list(self._samples))
        if self.ttft_slo_s is not None:
            self.limit.observe(ttfb, self.ttft_slo_s, now)

    def leave(self, ticket: Ticket) -> None:
        """It is over (answered, failed or hung up); no longer in flight."""
        self._stop_waiting(ticket)
        self.in_flight -= 1

    def _stop_waiting(self, ticket: Ticket) -> bool:
        if id(ticket) not in self._waiting:
            return False
        self._waiting.discard(id(ticket))
        self._waiting_kib = max(0.0, self._waiting_kib - ticket.kib)
        return True
