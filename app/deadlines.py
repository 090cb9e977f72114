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
(the legs' stage stamps, ``app.timeline``) as a line ``base + s_per_token * n``, with admission's
least squares (``app.admission.fit``: an intercept for each step's overhead, proportional where the
lengths are too alike for a slope), assumed at ``handoff.assumed_prefill_tokens_per_s`` until enough
legs have been measured. (A through-origin ``a*n + b*n^2`` fit, tried first, read short prompts'
per-step overhead as attention's ``n^2`` and gave a 520-token prompt minutes.) A request that waits behind others is not a failure: the work ahead of
it is part of what it is expected to take. The queue deadline only grows by the request's own
work: the time a request may *wait* is the setting; the time it takes is its own.
"""

from __future__ import annotations

from collections import deque

from app.admission import Line, fit
from app.args import HandoffArgs

WINDOW = 16  # prefill legs the cost remembers: recent enough to follow a box that slowed down


class PrefillCost:
    """Seconds a prefill engine computes a prompt of ``n`` tokens alone, learned from measured legs
    (the caller feeds it only legs that found nothing ahead of them: one computed in a batch with
    others would make every token look as dear as the whole batch)."""

    def __init__(self, assumed_tokens_per_s: float):
        self._assumed = Line(0.0, 1.0 / assumed_tokens_per_s)
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._fit: Line | None = None

    @property
    def measured(self) -> bool:
        return self._fit is not None

    def observe(self, tokens: int, seconds: float) -> None:
        """One leg's compute: ``tokens`` computed (no reused history) in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((float(tokens), seconds))
        self._fit = fit(list(self._samples))

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return (self._fit or self._assumed).estimate(tokens)


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
