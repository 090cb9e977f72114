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
ready", "prefill": "starting", ...}``, plus ``"failure"`` while a role's replicas fail to
start (Serve's own message, e.g. a taken side-channel port: ``connector.port_check``), which
``make serve`` prints. While not ready, generation requests get a quick 503 with
``Retry-After`` instead of a wait in a queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger("ray.serve." + __name__)

# Deployment name prefixes (app.builder names the deployments with them).
DECODE_PREFIX = "Decode:"
PREFILL_PREFIX = "Prefill:"
# Serve's ReplicaState values of a replica that serves: RUNNING, and two states of one that was running and still is:
# RECOVERING (a controller restarted with the head, GCS fault tolerance, re-attaching it: seconds after the head's
# return, with nothing wrong), and PENDING_MIGRATION (its node drains; it serves until its replacement runs).
SERVING = ("RUNNING", "RECOVERING", "PENDING_MIGRATION")
GAVE_UP = "DEPLOY_FAILED"  # Serve's DeploymentStatus once replicas failed to start too often
# In a start failure's text once Serve stopped retrying (make serve then stops the app).
GAVE_UP_TEXT = "failed to start; Serve gave up"
# How Serve's deployment message starts while it retries a replica that failed to start.
_RETRYING = "A replica failed to start"
# How long a read of Serve's state is reused; generation requests never wait for a read
# once there is one (they get the last answer while the next is read).
REFRESH_S = 1.0
# How long /ready waits for Serve's controller to answer. serve.status() retries until the controller is back, and
# with GCS fault tolerance the head (and the controller on it) restarts while every replica keeps serving: a probe
# that waited with it would fail the pods' readiness checks and empty the Service. Past this, the last answer stands.
READ_WAIT_S = 2.0
RETRY_AFTER_S = 5  # a starting engine takes minutes; a replaced one tens of seconds


@dataclass(frozen=True)
class Replicas:
    running: int
    total: int

    def __str__(self) -> str:
        return f"{self.running}/{self.total} replicas ready"


@dataclass(frozen=True)
class Deployment:
    """What Serve says of one deployment: replica state -> count, its status and message."""

    replica_states: dict[str, int]
    status: str = ""
    message: str = ""


@dataclass(frozen=True)
class Readiness:
    ready: bool
    mode: str
    decode: str
    prefill: str
    decode_replicas: int = 0  # running
    prefill_replicas: int = 0
    failure: str | None = None  # why a role's replicas fail to start (start_failure)

    def body(self) -> dict:
        body = {
            "ready": self.ready, "mode": self.mode, "decode": self.decode, "prefill": self.prefill,
            "decode_replicas": self.decode_replicas, "prefill_replicas": self.prefill_replicas,
        }
        return body if self.failure is None else {**body, "failure": self.failure}

    @property
    def reason(self) -> str:
        return f"decode: {self.decode}; prefill: {self.prefill}"


def decide(mode: str, decode: Replicas | None, prefill: Replicas | None, prefill_was_up: bool,
           failure: str | None = None) -> Readiness:
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
        failure=failure,
    )


def replicas_by_role(replica_states: dict[str, dict[str, int]]) -> tuple[Replicas | None, Replicas | None]:
    """Decode and prefill replica counts from ``{deployment name: {replica state: count}}``
    (pure). Several deployments of a role (several models) add up."""
    found: dict[str, Replicas] = {}
    for name, states in replica_states.items():
        role = DECODE_PREFIX if name.startswith(DECODE_PREFIX) else PREFILL_PREFIX if name.startswith(PREFILL_PREFIX) else None
        if role is None:
            continue
        running = sum(int(states.get(state, 0)) for state in SERVING)
        total = sum(int(n) for n in states.values())
        before = found.get(role, Replicas(0, 0))
        found[role] = Replicas(before.running + running, before.total + total)
    return found.get(DECODE_PREFIX), found.get(PREFILL_PREFIX)


def start_failure(deployments: dict[str, Deployment]) -> str | None:
    """Why decode or prefill replicas fail to start, from Serve's deployment message (pure):
    its last line, the exception (``connector.port_check.PortBusy: decode NIXL side-channel
    port … is held by pid …``), with whether Serve still retries or gave up."""
    for name, deployment in deployments.items():
        role = "decode" if name.startswith(DECODE_PREFIX) else "prefill" if name.startswith(PREFILL_PREFIX) else None
        gave_up = deployment.status == GAVE_UP
        if role is None or not (gave_up or deployment.message.startswith(_RETRYING)):
            continue
        lines = [line.strip() for line in deployment.message.splitlines() if line.strip()]
        return f"{role} replicas {GAVE_UP_TEXT if gave_up else 'fail to start; Serve retries'}: " + (
            lines[-1] if lines else "no reason given")
    return None


def _serve_deployments() -> dict[str, Deployment]:
    """This application's deployments as Serve's controller sees them (blocking)."""
    from ray import serve

    app_name = serve.get_replica_context().app_name
    application = serve.status().applications.get(app_name)
    if application is None:
        return {}
    return {
        name: Deployment(
            {str(getattr(state, "value", state)): count for state, count in deployment.replica_states.items()},
            str(getattr(deployment.status, "value", deployment.status)),
            deployment.message or "",
        )
        for name, deployment in application.deployments.items()
    }


class ReadinessProbe:
    """One per ingress replica: Serve's deployments, read at most every :data:`REFRESH_S`."""

    def __init__(self, mode: str, read_deployments=_serve_deployments, clock=time.monotonic, read_wait_s: float = READ_WAIT_S):
        self._mode = mode
        self._read_deployments = read_deployments
        self._clock = clock
        self._read_wait_s = read_wait_s
        self._prefill_was_up = False
        self._last: Readiness | None = None
        self._read_at = float("-inf")
        self._reading: asyncio.Task | None = None

    async def fresh(self) -> Readiness:
        """The state now (reads Serve unless the last read is recent): for ``/ready``. A read the controller does
        not answer within ``READ_WAIT_S`` goes on behind the last answer (one read at a time)."""
        if self._clock() - self._read_at > REFRESH_S or self._last is None:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read())
            try:
                await asyncio.wait_for(asyncio.shield(self._reading), self._read_wait_s)
            except asyncio.TimeoutError:
                logger.warning("Serve's controller did not answer within %.0f s (restarting?); readiness unchanged",
                               self._read_wait_s)
                if self._last is None:
                    self._last = Readiness(False, self._mode, "unknown", "unknown")
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
            deployments = await asyncio.to_thread(self._read_deployments)
        except Exception as exc:  # noqa: BLE001 - the controller is briefly unreachable: keep the last answer
            logger.warning("could not read Serve's replica states (%r); readiness unchanged", exc)
            if self._last is None:
                self._last = Readiness(False, self._mode, "unknown", "unknown")
            return
        states = {name: deployment.replica_states for name, deployment in deployments.items()}
        readiness = decide(self._mode, *replicas_by_role(states), self._prefill_was_up, start_failure(deployments))
        self._prefill_was_up = self._prefill_was_up or readiness.prefill_replicas > 0
        if self._last is None or readiness.ready != self._last.ready:
            logger.info("ready: %s (%s)", readiness.ready, readiness.reason)
        if readiness.failure and (self._last is None or readiness.failure != self._last.failure):
            logger.warning("%s", readiness.failure)
        self._last, self._read_at = readiness, self._clock()
