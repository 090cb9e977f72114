"""Ready means able to answer: the readiness of the disaggregated app, from Serve's own
replica states (the decision is pure; :class:`ReadinessProbe` reads Serve).

A Serve replica is RUNNING only once its constructor returned — for ours, once its vLLM
engine is up — and it leaves RUNNING when its health check (the engine's) fails or its
process dies. So the app can answer when at least one decode replica runs and, for the
remote prefill, a prefill replica runs too. A prefill deployment that *was* up and is now
down does not make the app unready: decode replicas prefill locally then (the fallback
ladder), slower but correct. One that has never been up (start-up) does: the first
requests would wait for the prefill timeout. "Has been up" is each ingress replica's own
memory: one that starts while prefill is down reports not ready until prefill is back.

``/health`` stays liveness (the ingress answers); ``/ready`` is readiness: 200 or 503 with
the same JSON body, e.g. ``{"ready": false, "mode": "push", "decode": "0/1 replicas
ready", "prefill": "starting", ...}``. While not ready, generation requests get a quick 503
with ``Retry-After`` instead of a wait in a queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("ray.serve.rendezvous.readiness")

# Deployment name prefixes (app.builder names the deployments with them).
DECODE_PREFIX = "Decode:"
PREFILL_PREFIX = "Prefill:"
RUNNING = "RUNNING"  # Serve's ReplicaState value of a replica that serves
# How long a read of Serve's state is reused; generation requests never wait for a read
# once there is one (they get the last answer while the next is read).
REFRESH_S = 1.0
RETRY_AFTER_S = 5  # a starting engine takes minutes; a replaced one tens of seconds


@dataclass(frozen=True)
class Replicas:
    running: int
    total: int

    def __str__(self) -> str:
        return f"{self.running}/{self.total} replicas ready"


@dataclass(frozen=True)
class Readiness:
    ready: bool
    mode: str
    decode: str
    prefill: str
    decode_replicas: int = 0  # running
    prefill_replicas: int = 0

    def body(self) -> dict:
        return {
            "ready": self.ready, "mode": self.mode, "decode": self.decode, "prefill": self.prefill,
            "decode_replicas": self.decode_replicas, "prefill_replicas": self.prefill_replicas,
        }

    @property
    def reason(self) -> str:
        return f"decode: {self.decode}; prefill: {self.prefill}"


def decide(mode: str, decode: Replicas | None, prefill: Replicas | None, prefill_was_up: bool) -> Readiness:
    """Whether the app can answer, and what is missing (pure). ``None``: no such deployment
    in Serve's state (yet, or any more)."""
    decode_up = decode is not None and decode.running > 0
    prefill_up = prefill is not None and prefill.running > 0
    if decode is None:
        decode_text = "not deployed"
    elif decode_up:
        decode_text = str(decode)
    else:
        decode_text = f"{decode} (starting or replaced)"
    if prefill_up:
        prefill_text = str(prefill)
    elif prefill_was_up:
        total = prefill.total if prefill is not None else 0
        prefill_text = f"0/{total} replicas ready: decode replicas prefill locally"
    else:
        prefill_text = "starting" if prefill is not None else "not deployed"
    return Readiness(
        ready=decode_up and (prefill_up or prefill_was_up),
        mode=mode,
        decode=decode_text,
        prefill=prefill_text,
        decode_replicas=decode.running if decode is not None else 0,
        prefill_replicas=prefill.running if prefill is not None else 0,
    )


def replicas_by_role(replica_states: dict[str, dict[str, int]]) -> tuple[Replicas | None, Replicas | None]:
    """Decode and prefill replica counts from ``{deployment name: {replica state: count}}``
    (pure). Several deployments of a role (several models) add up."""
    found: dict[str, Replicas] = {}
    for name, states in replica_states.items():
        role = DECODE_PREFIX if name.startswith(DECODE_PREFIX) else PREFILL_PREFIX if name.startswith(PREFILL_PREFIX) else None
        if role is None:
            continue
        running = int(states.get(RUNNING, 0))
        total = sum(int(n) for n in states.values())
        before = found.get(role, Replicas(0, 0))
        found[role] = Replicas(before.running + running, before.total + total)
    return found.get(DECODE_PREFIX), found.get(PREFILL_PREFIX)


def _serve_replica_states() -> dict[str, dict[str, int]]:
    """This application's deployments' replica states, from Serve's controller (blocking)."""
    from ray import serve

    app_name = serve.get_replica_context().app_name
    application = serve.status().applications.get(app_name)
    if application is None:
        return {}
    return {
        name: {str(getattr(state, "value", state)): count for state, count in deployment.replica_states.items()}
        for name, deployment in application.deployments.items()
    }


class ReadinessProbe:
    """One per ingress replica: Serve's replica states, read at most every :data:`REFRESH_S`."""

    def __init__(self, mode: str, read_states=_serve_replica_states, clock=time.monotonic):
        self._mode = mode
        self._read_states = read_states
        self._clock = clock
        self._prefill_was_up = False
        self._last: Readiness | None = None
        self._read_at = float("-inf")
        self._reading: asyncio.Task | None = None

    async def fresh(self) -> Readiness:
        """The state now (reads Serve unless the last read is recent): for ``/ready``."""
        if self._clock() - self._read_at > REFRESH_S or self._last is None:
            await self._read()
        return self._last

    async def current(self) -> Readiness:
        """The last state read, reading the next in the background: for generation requests,
        which must not wait on the controller."""
        if self._last is None:
            return await self.fresh()
        if self._clock() - self._read_at > REFRESH_S and (self._reading is None or self._reading.done()):
            self._reading = asyncio.ensure_future(self._read())
        return self._last

    async def _read(self) -> None:
        try:
            states = await asyncio.to_thread(self._read_states)
        except Exception as exc:  # noqa: BLE001 - the controller is briefly unreachable: keep the last answer
            logger.warning("could not read Serve's replica states (%r); readiness unchanged", exc)
            if self._last is None:
                self._last = Readiness(False, self._mode, "unknown", "unknown")
            return
        readiness = decide(self._mode, *replicas_by_role(states), self._prefill_was_up)
        self._prefill_was_up = self._prefill_was_up or readiness.prefill_replicas > 0
        if self._last is None or readiness.ready != self._last.ready:
            logger.info("ready: %s (%s)", readiness.ready, readiness.reason)
        self._last, self._read_at = readiness, self._clock()
