"""Deadlines sized to the request's own work (pure: no Ray, no vLLM, no HTTP).

A fixed wall-clock deadline cannot be right. The same 3.4k-token prompt prefills in 15 s on
this box one day and in 30 the next, in well under a second on a GPU, and twice as slowly
again with a neighbour on the cores: any constant either abandons valid requests on a slow
day or waits minutes for a dead engine on a fast one. So every deadline of the fallback
ladder is the request's *expected* work on the replica that runs it, times a margin, never
less than the configured floor:

    expected_s      = prefill_s(own tokens) + the tokens queued ahead on its prefill replica
                      at the per-token cost of its own
    prefill         = max(handoff.prefill_timeout_s, margin * expected_s)      after dispatch
    KV (push)       = prefill + (handoff.kv_timeout_s - handoff.prefill_timeout_s)  after registration
    queue           = ingress.queue_deadline_s + (margin + 1) * prefill_s(own tokens)  after admission

``prefill_s`` is :class:`PrefillCost`: learned from the prefill engine's own compute times
(the legs' stage stamps, ``app.timeline``) as ``a*n + b*n^2`` (attention makes long
prompts dearer per token), assumed at ``handoff.assumed_prefill_tokens_per_s`` until the first
leg has been measured. A request that waits behind others is not a failure: the work ahead of
it is part of what it is expected to take. The queue deadline only grows by the request's own
work: the time a request may *wait* is the setting; the time it takes is its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from app.args import HandoffArgs

WINDOW = 16  # prefill legs the cost remembers: recent enough to follow a box that slowed down
MIN_SPREAD = 0.25  # prompt-length range / mean below which the n^2 term is noise: cost taken as proportional


@dataclass(frozen=True)
class Fitted:
    """seconds = per_token * n + per_token2 * n^2 (both >= 0)."""

    per_token: float
    per_token2: float = 0.0

    def seconds(self, tokens: float) -> float:
        return self.per_token * tokens + self.per_token2 * tokens * tokens


def fit_cost(samples: list[tuple[int, float]]) -> Fitted | None:
    """Least squares through the origin of (tokens, seconds) on ``n`` and ``n^2``; with too
    little spread in ``n``, or a negative term, the proportional fit. None without samples."""
    samples = [(n, s) for n, s in samples if n > 0 and s >= 0]
    if not samples:
        return None
    s11 = sum(n * n for n, _ in samples)
    proportional = Fitted(sum(n * s for n, s in samples) / s11)
    lengths = [n for n, _ in samples]
    mean = sum(lengths) / len(lengths)
    if len(samples) < 2 or max(lengths) - min(lengths) < MIN_SPREAD * mean:
        return proportional
    s12 = sum(n ** 3 for n, _ in samples)
    s22 = sum(n ** 4 for n, _ in samples)
    t1 = sum(n * s for n, s in samples)
    t2 = sum(n * n * s for n, s in samples)
    det = s11 * s22 - s12 * s12
    if det <= 0:
        return proportional
    a, b = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
    return Fitted(a, b) if a >= 0 and b >= 0 else proportional


class PrefillCost:
    """Seconds a prefill engine computes a prompt of ``n`` tokens alone, learned from measured legs
    (the caller feeds it only legs that found nothing ahead of them: one computed in a batch with
    others would make every token look as dear as the whole batch)."""

    def __init__(self, assumed_tokens_per_s: float):
        self._assumed = Fitted(1.0 / assumed_tokens_per_s)
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._fit: Fitted | None = None

    @property
    def measured(self) -> bool:
        return self._fit is not None

    def observe(self, tokens: int, seconds: float) -> None:
        """One leg's compute: ``tokens`` computed (no reused history) in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((tokens, seconds))
        self._fit = fit_cost(list(self._samples))

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return (self._fit or self._assumed).seconds(tokens)


class Deadlines:
    """One decode replica's deadlines (seconds from the moment each one starts), and the prefill
    cost they are sized by, which it learns from its own prefill legs."""

    @classmethod
    def of(cls, handoff: HandoffArgs) -> Deadlines:
        return cls(prefill_floor_s=handoff.prefill_timeout_s, kv_after_prefill_s=handoff.kv_timeout_s - handoff.prefill_timeout_s,
                   margin=handoff.deadline_margin, assumed_prefill_tokens_per_s=handoff.assumed_prefill_tokens_per_s)

    def __init__(self, *, prefill_floor_s: float, kv_after_prefill_s: float, margin: float,
                 assumed_prefill_tokens_per_s: float):
        self.prefill_floor_s = prefill_floor_s  # handoff.prefill_timeout_s
        self.kv_after_prefill_s = kv_after_prefill_s  # handoff.kv_timeout_s - prefill_timeout_s: the WRITE's allowance
        self.margin = margin  # handoff.deadline_margin
        self.cost = PrefillCost(assumed_prefill_tokens_per_s)

    def expected_s(self, own_tokens: int, ahead_tokens: int = 0) -> float:
        """The request's prefill, and the work queued ahead of it at its own per-token cost."""
        own = self.cost.seconds(own_tokens)
        per_token = own / own_tokens if own_tokens > 0 else self.cost.seconds(1)
        return own + per_token * max(0, ahead_tokens)

    def prefill_s(self, own_tokens: int, ahead_tokens: int = 0) -> float:
        return max(self.prefill_floor_s, self.margin * self.expected_s(own_tokens, ahead_tokens))

    @property
    def kv_floor_s(self) -> float:
        """handoff.kv_timeout_s: the KV deadline decode's engine applies to a leg that names none."""
        return self.prefill_floor_s + self.kv_after_prefill_s

    def kv_s(self, own_tokens: int, ahead_tokens: int = 0) -> float:
        """Push: from decode's registration to the KV's expiry; always past the prefill deadline."""
        return self.prefill_s(own_tokens, ahead_tokens) + self.kv_after_prefill_s

    def queue_extension_s(self, own_tokens: int) -> float:
        """What the queue deadline grows by: the request's own work, never the work ahead of it. Time
        enough for a remote prefill to miss its deadline (the margin) and decode to compute it itself (one
        more): a fallback always comes before the queue deadline's 503."""
        return (self.margin + 1) * self.cost.seconds(own_tokens)
