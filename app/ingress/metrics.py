"""The ingress's metrics (Ray Serve's, so each carries its deployment and replica): what admission
decided (app/routing/admission.py), what the ingress turned away or lost, and each request's stage durations."""

from __future__ import annotations

import asyncio
import functools

from ray.serve.metrics import Counter, Gauge, Histogram

from app.routing.admission import Admission

# Ray drops a gauge not set again within two export intervals (at least 1 s each; 10 s by default):
# admission's are re-set this often, so they stay exported at any interval an operator sets.
GAUGE_REFRESH_S = 1.0


@functools.cache
def rejected() -> Counter:
    return Counter(
        "rendezvous_ingress_rejected",
        description="Requests the ingress turned away before they reached a model, by reason: over_slo (429, expected "
        "time to first byte beyond ingress.ttft_slo_s), limit (429, the adaptive limit while there is no estimate), busy "
        "(429, max_in_flight reached), not_ready (503, no decode replica can answer: app/ingress/readiness.py), too_large (413), "
        "unauthorized (401).",
        tag_keys=("reason",),
    )


@functools.cache
def admitted() -> Counter:
    return Counter(
        "rendezvous_ingress_admitted",
        description="Generation requests the ingress admitted, by reason (app/routing/admission.py): estimate (expected time "
        "to first byte within ingress.ttft_slo_s), idle (almost nothing in flight), limit (no estimate yet: under the "
        "adaptive limit), unlimited (no SLO configured).",
        tag_keys=("reason",),
    )


@functools.cache
def expired() -> Counter:
    return Counter(
        "rendezvous_ingress_expired",
        description="Admitted requests whose first token was not out by ingress.queue_deadline_s: answered 503 and aborted.",
    )


@functools.cache
def _gauges() -> dict[str, Gauge]:
    return {
        "estimate": Gauge("rendezvous_ingress_ttft_estimate_seconds", description="Expected time to first byte of "
                          "the last arrival at this ingress replica (app/routing/admission.py); absent until it has learned."),
        "limit": Gauge("rendezvous_ingress_in_flight_limit", description="The adaptive in-flight limit (AIMD on "
                       "time to first byte) that decides while there is no estimate; never above max_in_flight."),
        "in_flight": Gauge("rendezvous_ingress_in_flight", description="Generation requests in flight on this "
                           "ingress replica."),
    }


def admission_gauges(admission: Admission) -> None:
    gauges = _gauges()
    if admission.last_estimate_s is not None:
        gauges["estimate"].set(admission.last_estimate_s)
    gauges["limit"].set(admission.limit.value)
    gauges["in_flight"].set(admission.in_flight)


@functools.cache
def decode_lost() -> Counter:
    return Counter(
        "rendezvous_decode_lost",
        description="Requests whose decode replica died or became unreachable, by when: before_first_chunk (sent "
        "through the router once more) or mid_stream (the stream ended with an error event).",
        tag_keys=("when",),
    )


@functools.cache
def stage_seconds() -> Histogram:
    return Histogram(
        "rendezvous_stage_seconds",
        description="Seconds each stage of a request took, by transfer mode and stage (app/request/timeline.py): route "
        "(decode_pick + decode_hop), bind, prefill_pick, prefill_hop, prefill_queue, prefill_compute, register, handoff "
        "(KV to decode and its first step: transfer + first_step; push's transfer = write_wait + write, pull's ends with "
        "read; first_step = schedule + forward + output), streamed (progressive push: the first chunk WRITE landed to prefill's end, overlapping prefill_compute), "
        "local_prefill, deliver (first token to the client), ttft.",
        boundaries=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64],
        tag_keys=("mode", "stage"),
    )


async def refresh_admission_gauges(admission: Admission) -> None:
    """Keep the admission gauges exported while the replica is idle (run as a task)."""
    while True:
        admission_gauges(admission)
        await asyncio.sleep(GAUGE_REFRESH_S)

