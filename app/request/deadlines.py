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

``prefill_s`` is :class:`PrefillCost`, learned where the prompt is computed: each prefill replica
fits its own engine's compute times (the legs' stage stamps, ``connector.stages``) as a line
``base + s_per_token * n`` with admission's least squares (``app.routing.admission.fit``: an intercept for each
step's overhead, proportional where the lengths are too alike for a slope, or while fewer legs than
the fit needs were measured), from the legs it computed
alone (it knows: it counts its own legs; a leg batched with others would make every token look as
dear as the whole batch), and publishes the line with its load (``app.routing.pipeline.PublishedLoad``). The
prefill router of each decode replica keeps what the current prefill replicas published
(:data:`PUBLISHED`, at every change Serve hands it), and the decode replica's deadlines read it, again
while a request waits: every decode replica knows the cost from the legs of all of them, a request
sent before a measurement is sized by it once it is made. Before any line is published the cost
is assumed at ``handoff.assumed_prefill_tokens_per_s``. (A through-origin ``a*n + b*n^2`` fit, tried
first, read short prompts' per-step overhead as attention's ``n^2`` and gave a 520-token prompt
minutes; a cost each decode replica learned from its own legs did not know of the other decode
replicas' legs ahead of its own, and a replica that had sent few legs sized a queue deadline by the
assumption.) A request that waits behind others is not a failure: the work ahead of
it is part of what it is expected to take. The queue deadline only grows by the request's own
work: the time a request may *wait* is the setting; the time it takes is its own.
"""

from __future__ import annotations

from collections import deque

from app.config.args import HandoffArgs
from app.routing.admission import Line, fit

WINDOW = 16  # prefill legs the cost remembers: recent enough to follow a box that slowed down


class PrefillCost:
    """Seconds one prefill engine computes a prompt of ``n`` tokens alone, learned from its measured
    legs (the prefill replica feeds it only legs that had its engine to themselves)."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self.line: Line | None = None
        self.fitted = False  # the line is a least-squares fit, not the few legs' seconds per token

    def observe(self, tokens: int, seconds: float) -> None:
        """One leg's compute: ``tokens`` computed in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((float(tokens), seconds))
        fitted = fit(list(self._samples))
        # Below fit's minimum, the legs' seconds per token, provisional: a short leg's per-step overhead makes
        # it far dearer per token than a long prompt's, so the decode replicas take it only where it is
        # faster than their assumption (Deadlines.cost_s).
        self.line = fitted or Line(0.0, sum(s for _, s in self._samples) / sum(n for n, _ in self._samples))
        self.fitted = fitted is not None


class SoloLegs:
    """A prefill replica's legs, telling those that had its engine to themselves (none in flight here
    when it came, none started before it computed), whose compute times :attr:`cost` learns from."""

    def __init__(self) -> None:
        self.cost = PrefillCost()
        self.in_flight = 0
        self._started = 0

    def begin(self) -> int | None:
        """A leg arrived; its ticket if it came alone."""
        alone = self.in_flight == 0
        self.in_flight += 1
        self._started += 1
        return self._started if alone else None

    def computed(self, ticket: int | None, tokens: int | None, prompt_tokens: int | None, seconds: float | None) -> None:
        """Its engine computed ``tokens`` of its ``prompt_tokens`` in ``seconds``: a sample if it was alone
        throughout and computed its whole prompt (one that read a history back computed less than it is long)."""
        if ticket is not None and ticket == self._started and tokens is not None and tokens == prompt_tokens and seconds:
            self.cost.observe(tokens, seconds)

    def end(self) -> None:
        self.in_flight -= 1


class PublishedCosts:
    """The cost lines the current prefill replicas published, each with whether it is a fit, as this
    process's prefill router last saw them (a replica that is gone is forgotten)."""

    def __init__(self) -> None:
        self._lines: dict[str, tuple[Line, bool]] = {}

    def replace(self, lines: dict[str, tuple[Line, bool]]) -> None:
        self._lines = dict(lines)

    def seconds(self, tokens: int, assumed: Line) -> float | None:
        """The slowest replica's estimate (the leg may go to any of them), a provisional line's no slower than
        ``assumed``; None before any published."""
        return max((line.estimate(tokens) if fitted else min(line.estimate(tokens), assumed.estimate(tokens))
                    for line, fitted in self._lines.values()), default=None)


# One per process: the prefill router (``app.routing.prefill_router``) writes it, the decode replica's deadlines read it.
PUBLISHED = PublishedCosts()


def published_prefill_costs(lines: dict[str, tuple[Line, bool]]) -> None:
    """The prefill router's way in: Serve pickles the router's module by value, so an object it imported
    would be a copy in the replica; this function, pickled by reference, reaches the real one."""
    PUBLISHED.replace(lines)


class Deadlines:
    """One decode replica's deadlines (seconds from the moment each one starts), sized by the prefill
    cost its prefill replicas published."""

    @classmethod
    def of(cls, handoff: HandoffArgs, published: PublishedCosts = PUBLISHED) -> Deadlines:
        return cls(prefill_floor_s=handoff.prefill_timeout_s, kv_after_prefill_s=handoff.kv_timeout_s - handoff.prefill_timeout_s,
                   margin=handoff.deadline_margin, assumed_prefill_tokens_per_s=handoff.assumed_prefill_tokens_per_s,
                   published=published)

    def __init__(self, *, prefill_floor_s: float, kv_after_prefill_s: float, margin: float,
                 assumed_prefill_tokens_per_s: float, published: PublishedCosts | None = None):
        self.prefill_floor_s = prefill_floor_s  # handoff.prefill_timeout_s
        self.kv_after_prefill_s = kv_after_prefill_s  # handoff.kv_timeout_s - prefill_timeout_s: the WRITE's allowance
        self.margin = margin  # handoff.deadline_margin
        self._assumed = Line(0.0, 1.0 / assumed_prefill_tokens_per_s)
        self._published = published if published is not None else PublishedCosts()  # of() gives the process's

    def cost_s(self, tokens: int) -> float:
        """The prefill of ``tokens`` prompt tokens alone: as published, else as assumed."""
        if tokens <= 0:
            return 0.0
        published = self._published.seconds(tokens, self._assumed)
        return published if published is not None else self._assumed.estimate(tokens)

    def expected_s(self, own_tokens: int, ahead_tokens: int = 0) -> float:
        """The request's prefill, and the work queued ahead of it at its own per-token cost."""
        own = self.cost_s(own_tokens)
        per_token = own / own_tokens if own_tokens > 0 else self.cost_s(1)
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
        return (self.margin + 1) * self.cost_s(own_tokens)
