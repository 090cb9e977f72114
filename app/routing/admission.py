"""Admission by expected time to first byte (pure: no Ray, no HTTP; one per ingress replica).

A fixed count of requests in flight cannot be right: whether 48 in flight means 2 s or
5 minutes of waiting depends on prompt and output lengths, mode, hardware and replica
count. What a client sees is its time to first byte (TTFB): a stream's first token, but a
whole answer for a request that is not streamed, which its client waits for to the last
token. So each ingress replica models both parts from what it has seen:

    TTFT ~ base_s + s_per_kib * (KiB of request bodies admitted here and not yet answered,
                                 the new request's own included)
    TPOT ~ base_s + s_per_request * (requests in flight here, its own included)
    TTFB = TTFT                              for a stream
         = TTFT + max_tokens * TPOT          for a whole answer

each fitted by least squares over the last ``WINDOW`` answers (TTFT: the work ahead of each when
it was admitted, and when its first token came, which a whole answer's timeline says; TPOT: the
requests in flight when a whole answer was admitted, and its time per output token after the
first). Work is counted in body bytes, which the ingress has without tokenizing; bytes per token
is steady within a workload. The fits absorb that ratio, the prefill rate, the decode batch and
the other ingress replicas (each sees only its own arrivals and learns its share of the rate).
A request whose estimate exceeds the SLO gets 429 with a Retry-After of the time until the work
ahead would fit; a request that finds fewer than ``ALWAYS_ADMITTED`` in flight is admitted
whatever the estimate (its own length is not load: waiting cannot make it faster, and a model
still full of a past fault must not refuse light traffic).

Before ``MIN_SAMPLES`` answers (of whole answers, for a whole answer's estimate) there is no
estimate, and an AIMD limit on requests in flight
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
    whole: bool = False  # the estimate is of a whole answer (not streamed)


@dataclass(frozen=True)
class Ticket:
    """One admitted request, until it leaves."""

    kib: float
    ahead_kib: float  # work ahead of it when admitted, its own included
    admitted_at: float
    whole: bool = False  # its client waits for the whole answer (not streamed)
    in_flight: int = 1  # requests in flight here when admitted, its own included


@dataclass(frozen=True)
class Line:
    """seconds = base_s + slope * x (x: KiB ahead for TTFT, requests in flight for TPOT)."""

    base_s: float
    slope: float

    def estimate(self, x: float) -> float:
        return self.base_s + self.slope * x


def fit(samples: list[tuple[float, float]]) -> Line | None:
    """Least squares over (x, seconds); None below ``MIN_SAMPLES``. With too little spread in x,
    or a slope that is not positive (more work ahead never makes it faster), proportional to x."""
    if len(samples) < MIN_SAMPLES:
        return None
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    if mean_x <= 0:
        return Line(mean_y, 0.0)
    spread = max(x for x, _ in samples) - min(x for x, _ in samples)
    if spread >= MIN_SPREAD * mean_x:
        var = sum((x - mean_x) ** 2 for x, _ in samples)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / var
        base = mean_y - slope * mean_x
        if slope > 0 and base >= 0:
            return Line(base, slope)
    return Line(0.0, mean_y / mean_x)


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
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (KiB ahead, TTFT)
        self._model: Line | None = None
        self._tpot_samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (requests in flight, TPOT)
        self._tpot: Line | None = None
        self._waiting_kib = 0.0  # admitted, not yet answered
        self._waiting: set[int] = set()  # id() of their tickets
        self.in_flight = 0
        self.last_estimate_s: float | None = None

    @property
    def model(self) -> Line | None:
        return self._model

    @property
    def tpot_model(self) -> Line | None:
        return self._tpot

    def _estimate(self, ahead_kib: float, output_tokens: int) -> tuple[float | None, bool]:
        """The expected TTFB: TTFT, and for a whole answer its output tokens after the first; and
        whether it is all of it (without a TPOT model a whole answer's is only its TTFT: a bound
        that can refuse it, never admit it)."""
        if self._model is None or self.ttft_slo_s is None:
            return None, False
        ttft = self._model.estimate(ahead_kib)
        if output_tokens <= 1:
            return ttft, True
        if self._tpot is None:
            return ttft, False
        return ttft + (output_tokens - 1) * self._tpot.estimate(self.in_flight + 1), True

    def try_enter(self, body_bytes: int, now: float, output_tokens: int = 0) -> tuple[Decision, Ticket | None]:
        """``output_tokens``: what a whole answer's client waits for (its max_tokens); 0 for a stream."""
        kib = max(body_bytes, 1) / 1024
        ahead = self._waiting_kib + kib
        estimate, complete = self._estimate(ahead, output_tokens)
        self.last_estimate_s = estimate
        if self.in_flight >= self.max_in_flight:
            return Decision(False, Verdict.BUSY, estimate, self.retry_after_s), None
        if self.ttft_slo_s is None:
            verdict = Verdict.UNLIMITED
        elif self.in_flight < ALWAYS_ADMITTED:
            verdict = Verdict.IDLE
        elif estimate is not None and estimate > self.ttft_slo_s:
            wait = min(MAX_RETRY_AFTER_S, max(self.retry_after_s, math.ceil(estimate - self.ttft_slo_s)))
            return Decision(False, Verdict.OVER_SLO, estimate, wait, whole=output_tokens > 1), None
        elif estimate is not None and complete:
            verdict = Verdict.ESTIMATE
        elif self.limit.allows(self.in_flight):
            verdict = Verdict.LIMIT
        else:
            return Decision(False, Verdict.LIMIT, None, self.retry_after_s), None
        ticket = Ticket(kib, ahead, now, whole=output_tokens > 0, in_flight=self.in_flight + 1)
        self.in_flight += 1
        self._waiting.add(id(ticket))
        self._waiting_kib += kib
        return Decision(True, verdict, estimate, 0), ticket

    def answered(self, ticket: Ticket, now: float, first_token_at: float | None = None,
                 output_tokens: int | None = None) -> None:
        """Its first byte is out (or it was given up on at the queue deadline: the TTFB it would
        have had is at least that). A whole answer says when its first token came and how many it
        had, where it knows. Once per ticket; later calls do nothing."""
        if not self._stop_waiting(ticket):
            return
        ttfb = now - ticket.admitted_at
        first = first_token_at if first_token_at is not None and ticket.admitted_at <= first_token_at <= now else None
        if not ticket.whole or first is not None:
            self._samples.append((ticket.ahead_kib, (first or now) - ticket.admitted_at))
            self._model = fit(list(self._samples))
        if ticket.whole and first is not None and output_tokens is not None and output_tokens > 1:
            self._tpot_samples.append((float(ticket.in_flight), (now - first) / (output_tokens - 1)))
            self._tpot = fit(list(self._tpot_samples))
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
