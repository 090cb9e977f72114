"""Engines that wait for pushed KV without stepping (vLLM-side; imports neither Ray nor ``app``).

vLLM's engine loop (0.29 to 0.32) keeps stepping while a request waits for remote KV: each empty
step is a schedule, an RPC to the worker process and back, then 1 ms of sleep. The
worker process, woken that often, never leaves the busy loop of its RPC queue (vLLM's
``SpinCondition`` spins for a second after each message). A decode engine waiting for a
long prefill's push used 0.7 of a core doing that; on a 2-core box, that core is taken
from the prefill engine it is waiting for.

Here the engine core sleeps instead, inside the scheduler's ``build_connector_meta``
(before the step's RPC), when the step computes nothing, ships nothing to the worker,
and every unfinished request waits for remote KV. It wakes on:

* any engine input (a new request, an abort, a utility call): a hook on the engine
  core's input queue, so they wait for nothing;
* a worker event: pushed KV landed (a completion notification), a registration arrived
  (prefill), a transfer failed. The worker sends a datagram to an abstract UNIX socket
  named after the engine (same host, same network namespace);
* a cap: :data:`WAIT_CAP_S` when everything awaited is signalled, :data:`POLL_CAP_S` when
  something is not (a WRITE or READ this engine started completes silently). Deadlines
  (``connector.push_deadline``) are checked on each wake, so they fire at most a cap late.

While receives are due and the engine is idle, the worker's ``nixl-push-writer`` thread
drains NIXL notifications every :data:`NOTIF_POLL_S` itself (upstream, only engine steps make
it drain them; while the engine steps, each step still does), and a step that computed
nothing lets the worker's RPC reader wait on its socket instead of spinning. Not while it
steps: the writer's polls take the GIL from the forward pass in the same process (decode's
time per token). So that the worker knows the engine went idle before it sleeps, the first
idle step after a busy one never sleeps. Never with data parallel > 1 (ranks step together)
or a batch queue (async scheduling, a GPU's default, or pipeline parallel: the next step is
scheduled before the last one's output, landed KV included, is read): there the engine steps
as upstream does.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import socket
import threading
from typing import Any

from vllm.v1.request import RequestStatus

from connector.feature import Feature
from connector.side_notifs import SideRoutingQueue

logger = logging.getLogger("vllm.rendezvous")

# Set on the connector metadata of a step that scheduled nothing (scheduler -> worker).
IDLE_ATTR = "rendezvous_idle"
# Longest sleep while everything awaited wakes us (a bound on anything we missed). Each wake is a step
# and an RPC to the worker: at 0.1 s they were a third of a waiting decode engine's CPU (2026-12-05).
WAIT_CAP_S = 0.25
# Longest sleep while something awaited completes without a signal (our own WRITE or READ).
POLL_CAP_S = 0.01
# How often the writer thread drains NIXL notifications while pushed KV is due: at most this is added
# to an idle decode engine's handoff (seconds of prefill on CPU); 4 ms cost 0.027 of a core, 10 ms 0.011.
NOTIF_POLL_S = 0.01


def wake_address(engine_id: str, dp_rank: int) -> bytes:
    """Abstract UNIX socket name of one engine's wake channel (hashed: names are short)."""
    digest = hashlib.sha1(f"{engine_id}:{dp_rank}".encode()).hexdigest()[:24]
    return b"\0rendezvous-wake-" + digest.encode()


def idle_wait_s(statuses_and_pushed: list[tuple[RequestStatus, bool]], pending_push_work: bool) -> float | None:
    """How long an engine that computed nothing this step may sleep, or None (step on).

    ``statuses_and_pushed``: each request the scheduler holds, with whether its KV is
    pushed to this engine (decode in push mode). ``pending_push_work``: this engine has
    WRITEs to start or finish (prefill)."""
    unfinished = [(s, pushed) for s, pushed in statuses_and_pushed if not RequestStatus.is_finished(s)]
    if any(s != RequestStatus.WAITING_FOR_REMOTE_KVS for s, _ in unfinished):
        return None  # something can run (or waits on a thing we do not watch: grammar, streaming input)
    if not unfinished and not pending_push_work:
        return None  # nothing awaited: vLLM's own loop blocks on its input queue
    if pending_push_work or not all(pushed for _, pushed in unfinished):
        return POLL_CAP_S
    return WAIT_CAP_S


def held_only_wait_s(statuses: list[RequestStatus]) -> float | None:
    """Pull: how long an engine that computed nothing this step may sleep, or None (step on).

    ``statuses``: each request the scheduler holds unfinished. vLLM keeps stepping while a finished request's blocks
    wait for a peer's READ (prefill's prompt for decode; decode's conversation turn for prefill's read-back, 480 s):
    nothing this engine does moves them; each step only drains the peer's notifications and checks expiries, so
    those may come a cap late. Anything unfinished (a READ of ours, a heartbeat to send, a compute) steps as
    upstream does: its READ completes without a signal."""
    if any(not RequestStatus.is_finished(s) for s in statuses):
        return None
    return WAIT_CAP_S


def ships_work(meta: Any, scheduler_output: Any) -> bool:
    """True if this step's RPC carries something the worker must act on now."""
    return bool(
        scheduler_output.finished_req_ids
        or meta.reqs_to_recv or meta.reqs_to_save or meta.reqs_to_send or meta.reqs_not_processed
        or meta.push_registrations or meta.push_finished_blocks or meta.heartbeat_by_engine
    )


def engine_core() -> Any:
    """This process's engine core (vLLM's ``EngineCoreProc``), or None: the owner of the thread that
    feeds its input queue (its target is the core's ``process_input_sockets``). vLLM hands the connector no reference to it; the input thread is started
    after the scheduler (and our connector) are built, so look it up when first needed."""
    from vllm.v1.engine.core import EngineCoreProc

    for thread in threading.enumerate():
        owner = getattr(getattr(thread, "_target", None), "__self__", None)
        if isinstance(owner, EngineCoreProc):
            return owner
    return None


def rpc_reader() -> Any:
    """This worker process's RPC reader (vLLM's ``WorkerProc.rpc_broadcast_mq``), or None (no worker
    process: the uniprocess executor). vLLM hands the worker no reference to its ``WorkerProc``; the
    thread that watches the parent's death pipe (``WorkerProc.monitor_death_pipe``) is started with
    the worker's queues as its argument, the RPC reader first, before the first step."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    for thread in threading.enumerate():
        args = getattr(thread, "_args", ())
        queues = args[0] if args and isinstance(args[0], list) else []
        if thread.name == "DeathPipeMonitor" and queues and isinstance(queues[0], MessageQueue):
            return queues[0]
    return None


class EngineWake:
    """In the engine core process: an event set by engine input or a worker's datagram."""

    def __init__(self, input_queue: queue.Queue, address: bytes):
        self._event = threading.Event()
        self.armed = False  # a worker of ours has reached us: it will wake us when KV lands
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(address)
        put = input_queue.put

        def put_and_wake(item, block=True, timeout=None):  # put_nowait calls self.put too
            put(item, block, timeout)
            self._event.set()

        input_queue.put = put_and_wake
        threading.Thread(target=self._listen, name="rendezvous-wake", daemon=True).start()

    def _listen(self) -> None:
        while True:
            try:
                self._socket.recv(16)
            except OSError:
                return
            self.armed = True
            self._event.set()

    def wait(self, timeout: float) -> bool:
        woken = self._event.wait(timeout)
        # Cleared after the wait: a wake from before it ends it at once, and whatever a wake
        # lost here announced, the step that follows every wait sees.
        self._event.clear()
        return woken

    @classmethod
    def for_this_engine(cls, vllm_config, engine_id: str) -> EngineWake | None:
        from vllm.v1.engine.core import DPEngineCoreProc

        parallel = vllm_config.parallel_config
        core = engine_core()
        if core is None or isinstance(core, DPEngineCoreProc) or parallel.data_parallel_size > 1:
            logger.info("engine steps while it waits for KV (no engine core process here, or data parallel)")
            return None
        if vllm_config.max_concurrent_batches > 1:
            # A batch queue (async scheduling, on by default on GPUs; pipeline parallel) schedules the next step
            # before it reads the last one's output: KV that just landed would be seen only after a capped sleep.
            logger.info("engine steps while it waits for KV (batch queue of %d: async scheduling or pipeline "
                        "parallel)", vllm_config.max_concurrent_batches)
            return None
        try:
            return cls(core.input_queue, wake_address(engine_id, parallel.data_parallel_rank))
        except OSError as exc:
            logger.warning("engine steps while it waits for KV: no wake channel (%s)", exc)
            return None


class WorkerWake:
    """In a worker process: wakes its engine core, and lets the worker's RPC reader wait on
    its socket rather than spin after a step that computed nothing."""

    def __init__(self, engine_id: str, dp_rank: int):
        self._address = wake_address(engine_id, dp_rank)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._spin = None  # the SpinCondition of the multiprocessing executor's RPC queue
        self._spin_busy_s = None
        self._looked = False
        self.idle_now = False  # the last step the worker ran computed nothing

    def wake(self) -> None:
        try:
            self._socket.sendto(b"!", self._address)
        except OSError:  # no engine core listening (another executor, another host): it steps
            pass

    def idle(self, idle: bool) -> None:
        """After a step that computed nothing, the RPC reader waits on its socket at once
        rather than spin for vLLM's second, and the writer thread polls for notifications
        (only then). Only the worker's reader, on idle steps: the engine core's reader of
        step results was tried the same way and stalled steps by vLLM's 5 s lost-notification
        recheck (``SHM_READER_RECHECK_INTERVAL_MS``) on every request; this one showed none
        in 60 mixed requests and the suite."""
        self.idle_now = idle
        if not self._looked:
            self._looked = True
            self._spin = getattr(rpc_reader(), "_spin_condition", None)
            self._spin_busy_s = getattr(self._spin, "busy_loop_s", None)
            self.wake()  # first contact arms the engine core's waiting
        if self._spin is not None and self._spin_busy_s is not None:
            self._spin.busy_loop_s = 0.0 if idle else self._spin_busy_s



class _PollWhileDue(threading.Event):
    """The writer thread's wake event: its untimed waits become :data:`NOTIF_POLL_S` polls
    while ``due()`` (pushed KV expected), so notifications are drained with the engine asleep."""

    def __init__(self, due):
        super().__init__()
        self._due = due

    def wait(self, timeout=None):
        if timeout is None and self._due():
            timeout = NOTIF_POLL_S
        return super().wait(timeout)


class _WakeOnPut(queue.Queue):
    """vLLM's queue of failed receives (what it held carried over); each put wakes the engine to report it."""

    def __init__(self, wake, before: queue.Queue):
        super().__init__()
        self._wake = wake
        while not before.empty():
            super().put(before.get_nowait())

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self._wake()


class _WakingQueue(SideRoutingQueue):
    """Completion notifications forwarded by the writer thread; each one wakes the engine.
    Ours go aside (``connector.side_notifs``) and wait for the next step."""

    def __init__(self, wake, writer):
        super().__init__()
        self._wake, self._writer = wake, writer

    def put(self, item, block=True, timeout=None):
        if self.put_aside(item):
            return
        super().put(item, block, timeout)
        if threading.current_thread() is self._writer():  # the main thread re-queues some
            self._wake()


class IdleScheduler(Feature):
    """Sleeps the engine core through steps that can only wait (see the module docstring)."""

    UPSTREAM = frozenset({"_push_registration_deadlines", "_finished_request_blocks"})

    def __init__(self, host, vllm_config) -> None:
        super().__init__(host)
        self._vllm_config, self._engine_id = vllm_config, host.engine_id
        # What the scheduler holds, as vLLM tells the connector: from on_new_request to request_finished.
        self._requests: dict[str, Any] = {}
        self._wake: EngineWake | None = None
        self._looked = False  # for the engine core (its input thread starts after the scheduler is built)
        self._last_idle = False  # the last step sent to the worker computed nothing

    def new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def finished(self, request) -> None:
        self._requests.pop(request.request_id, None)

    def built(self, meta, scheduler_output) -> None:
        """After vLLM's build_connector_meta: mark an idle step for the worker; sleep if there is only waiting."""
        if not self._looked:  # at the first step, before the worker's first contact (WorkerWake.idle)
            self._looked = True
            self._wake = EngineWake.for_this_engine(self._vllm_config, self._engine_id)
        idle = scheduler_output.total_num_scheduled_tokens == 0
        setattr(meta, IDLE_ATTR, idle)
        # After a busy step, this idle one goes to the worker first: it starts polling then.
        was_idle, self._last_idle = self._last_idle, idle
        if idle and was_idle and self._wake is not None and self._wake.armed and not ships_work(meta, scheduler_output):
            timeout = self._timeout()
            if timeout is not None:
                self._wake.wait(timeout)

    def _timeout(self) -> float | None:
        # Decode's registrations that await a push (vLLM clears do_remote_prefill once sent).
        awaited = self._push_registration_deadlines
        requests = [(r.status, rid in awaited) for rid, r in self._requests.items()]
        return idle_wait_s(requests, bool(self._finished_request_blocks))


class PullIdleScheduler(IdleScheduler):
    """Pull: sleeps the engine core through steps that only hold finished requests' blocks for a peer's READ."""

    UPSTREAM = frozenset()

    def _timeout(self) -> float | None:
        return held_only_wait_s([r.status for r in self._requests.values()])


class PullIdleWorker(Feature):
    """Pull: arms the engine core's waiting, and lets the RPC reader wait on its socket after an idle step (no writer
    thread here: nothing this worker does while its engine sleeps)."""

    def __init__(self, host) -> None:
        super().__init__(host)
        self._wake = WorkerWake(host.engine_id, host.vllm_config.parallel_config.data_parallel_rank)

    def loading(self, metadata) -> None:
        """Before vLLM's start_load_kv: whether the step computed nothing."""
        self._wake.idle(getattr(metadata, IDLE_ATTR, False))


class IdleWorker(Feature):
    """Wakes the engine core when something it waits for happens (see the module docstring)."""

    UPSTREAM = frozenset({"_recving_metadata", "_push_writer_thread"})

    def __init__(self, host) -> None:
        super().__init__(host)
        dp_rank = host.vllm_config.parallel_config.data_parallel_rank
        self._wake = WorkerWake(host.engine_id, dp_rank)
        # vLLM's own objects, replaced by ones that wake the engine or poll while KV is due (the writer
        # thread is running already: each is whole before it is set).
        host._push_writer_wake = _PollWhileDue(lambda: bool(self._recving_metadata) and self._wake.idle_now)
        host._pending_completion_notifs = _WakingQueue(self._wake.wake, lambda: self._push_writer_thread)
        # A failed receive is queued here by whichever thread sees it (a handshake's callback, a deadline)
        host._failed_recv_reqs = _WakeOnPut(self._wake.wake, host._failed_recv_reqs)

    def loading(self, metadata) -> None:
        """Before vLLM's start_load_kv: whether the step computed nothing."""
        self._wake.idle(getattr(metadata, IDLE_ATTR, False))

    def registered(self) -> None:
        """After vLLM took a registration (prefill): its WRITE may start now."""
        self._wake.wake()
