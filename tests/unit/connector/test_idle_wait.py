"""connector.idle_wait: when an engine sleeps instead of stepping, and what wakes it.

The decision is a table; the wake channel is exercised for real (a queue, an abstract
UNIX socket, threads), as it runs inside an engine core and its worker."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from vllm.v1.request import RequestStatus as S

from connector.idle_wait import (
    NOTIF_POLL_S,
    POLL_CAP_S,
    WAIT_CAP_S,
    EngineWake,
    WorkerWake,
    _PollWhileDue,
    held_only_wait_s,
    idle_wait_s,
    ships_work,
    rpc_reader,
    wake_address,
)

R = S.WAITING_FOR_REMOTE_KVS


@pytest.mark.parametrize(
    "requests, push_work, expected",
    [
        ([(R, True)], False, WAIT_CAP_S),  # decode: every request waits for pushed KV
        ([(R, True), (R, True)], False, WAIT_CAP_S),
        ([(R, True), (S.FINISHED_STOPPED, False)], False, WAIT_CAP_S),  # finished ones wait for nothing
        ([(R, True), (S.RUNNING, False)], False, None),  # something to compute
        ([(R, True), (S.WAITING, False)], False, None),  # may be schedulable next step
        ([(S.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, False)], False, None),  # compiled in the background
        ([(S.WAITING_FOR_STREAMING_REQ, False)], False, None),
        ([(R, False)], False, POLL_CAP_S),  # a READ of ours (history read-back): completes silently
        ([], True, POLL_CAP_S),  # prefill: its WRITEs complete silently
        ([(S.FINISHED_LENGTH_CAPPED, False)], True, POLL_CAP_S),
        ([(R, True)], True, POLL_CAP_S),
        ([], False, None),  # nothing awaited: vLLM's loop blocks on its input queue
    ],
)
def test_how_long_an_engine_that_computed_nothing_may_sleep(requests, push_work, expected):
    assert idle_wait_s(requests, push_work) == expected


@pytest.mark.parametrize(
    "unfinished, expected",
    [
        ([], WAIT_CAP_S),  # only finished requests' blocks, held for a peer's READ: nothing here moves them
        ([S.FINISHED_STOPPED], WAIT_CAP_S),
        ([R], None),  # decode's own READ completes silently: step as upstream does
        ([S.WAITING], None),  # waiting in the queue: its lease wants heartbeats, it may be scheduled
        ([S.RUNNING], None),
        ([S.FINISHED_STOPPED, R], None),
    ],
)
def test_how_long_a_pull_engine_that_computed_nothing_may_sleep(unfinished, expected):
    assert held_only_wait_s(unfinished) == expected


def _meta(**fields):
    base = dict(reqs_to_recv={}, reqs_to_save={}, reqs_to_send={}, reqs_not_processed=set(), push_registrations={},
                push_finished_blocks={}, heartbeat_by_engine={})
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, finished, expected",
    [
        ({}, set(), False),
        ({"push_registrations": {"r": {}}}, set(), True),  # decode's registration must leave now
        ({"push_finished_blocks": {"r": [1]}}, set(), True),  # prefill's WRITE can start now
        ({"reqs_to_recv": {"r": 1}}, set(), True),
        ({"reqs_to_send": {"r": 1.0}}, set(), True),
        ({"reqs_to_save": {"r": 1}}, set(), True),
        ({"reqs_not_processed": {"r"}}, set(), True),
        ({"heartbeat_by_engine": {"e": 1}}, set(), True),
        ({}, {"r"}, True),  # the worker must learn of finished requests
    ],
)
def test_a_step_that_ships_work_to_the_worker_never_waits(fields, finished, expected):
    assert ships_work(_meta(**fields), SimpleNamespace(finished_req_ids=finished)) is expected


def test_wake_addresses_are_abstract_short_and_per_engine_and_rank():
    a = wake_address("decode-r0-10.0.0.5-22000-" + "x" * 200, 0)
    assert a.startswith(b"\0") and len(a) < 108  # the kernel's limit for UNIX socket names
    assert a != wake_address("decode-r0-10.0.0.5-22000-" + "x" * 200, 1) != wake_address("other", 0)


@pytest.fixture
def wake():
    inputs: queue.Queue = queue.Queue()
    engine_id = f"test-{uuid.uuid4().hex}"
    return inputs, EngineWake(inputs, wake_address(engine_id, 0)), WorkerWake(engine_id, 0)


def test_engine_input_ends_a_wait_at_once(wake):
    inputs, engine, _ = wake
    assert engine.wait(0.01) is False  # nothing happened: the cap
    threading.Timer(0.05, lambda: inputs.put_nowait(("ADD", "request"))).start()
    started = time.monotonic()
    assert engine.wait(5) is True
    assert time.monotonic() - started < 1
    assert inputs.get_nowait() == ("ADD", "request")  # the queue still works as a queue


def test_a_workers_datagram_arms_the_engine_and_ends_a_wait(wake):
    _, engine, worker = wake
    assert not engine.armed
    threading.Timer(0.05, worker.wake).start()
    started = time.monotonic()
    assert engine.wait(5) is True and time.monotonic() - started < 1
    assert engine.armed
    assert engine.wait(0.01) is False  # cleared: the next wait sleeps again


def test_a_wake_with_nobody_listening_is_dropped():
    WorkerWake(f"nobody-{uuid.uuid4().hex}", 0).wake()  # no exception, no block


def test_the_writer_thread_polls_only_while_pushed_kv_is_due():
    due = [True]
    event = _PollWhileDue(lambda: due[0])
    started = time.monotonic()
    assert event.wait() is False  # returns after one poll period instead of blocking
    assert time.monotonic() - started < NOTIF_POLL_S + 0.5
    due[0] = False
    threading.Timer(0.05, event.set).start()
    assert event.wait() is True  # untimed again: only a wake ends it


def test_the_writer_threads_notifications_wake_the_engine_and_ours_go_aside_without_waking_it():
    """vLLM parses every notification in the queue as "<request id>:<tp size>": ours (connector.side_notifs)
    never enter it, so no read of the queue can race the writer thread into handing vLLM one of ours."""
    from connector.idle_wait import _WakingQueue
    from connector.side_notifs import KV_SUMS_NOTIF, WRITE_STARTED_NOTIF, take
    from connector.stages import write_started_notif

    wakes, writer = [], threading.current_thread()
    notifs = _WakingQueue(lambda: wakes.append(1), lambda: writer)
    notifs.put(write_started_notif("chatcmpl-rdv-1", 1.0))  # read at the next step; waking for it costs a step
    notifs.put(KV_SUMS_NOTIF + b"\x83\xa1")  # not UTF-8: vLLM's parser would raise
    assert wakes == [] and notifs.qsize() == 0
    notifs.put(b"chatcmpl-rdv-1:1")  # pushed KV landed
    assert wakes == [1] and notifs.qsize() == 1
    writer = None  # the main thread re-queueing what it kept: no wake
    notifs.put(b"chatcmpl-rdv-2:1")
    assert wakes == [1]
    assert len(take(notifs, WRITE_STARTED_NOTIF)) == 1 and take(notifs, WRITE_STARTED_NOTIF) == []
    assert take(notifs, KV_SUMS_NOTIF) == [KV_SUMS_NOTIF + b"\x83\xa1"]


@pytest.fixture
def worker_rpc_reader():
    """A real RPC reader, handed to vLLM's own death-pipe thread as WorkerProc.monitor_death_pipe does."""
    import multiprocessing

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.v1.executor.multiproc_executor import WorkerProc

    assert rpc_reader() is None  # no worker process here (vLLM's uniprocess executor)
    writer = MessageQueue(n_reader=1, n_local_reader=1)  # the engine core's end
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)  # as WorkerProc.__init__ builds it
    pipe_out, pipe_in = multiprocessing.Pipe(duplex=False)
    WorkerProc.monitor_death_pipe(SimpleNamespace(rpc_broadcast_mq=reader, worker_response_mq=None), pipe_out,
                                  threading.Event())
    yield reader
    pipe_in.close()  # the parent "exits": vLLM's thread shuts the queue and returns
    deadline = time.monotonic() + 5
    while rpc_reader() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rpc_reader() is None


def test_rpc_reader_is_the_queue_vllm_hands_its_death_pipe_thread(worker_rpc_reader):
    assert rpc_reader() is worker_rpc_reader


def test_a_worker_after_an_idle_step_waits_on_its_rpc_socket_instead_of_spinning(worker_rpc_reader):
    spin = worker_rpc_reader._spin_condition
    busy = spin.busy_loop_s
    assert busy > 0  # vLLM spins after each message
    worker = WorkerWake(f"spin-{uuid.uuid4().hex}", 0)
    worker.idle(True)
    assert spin.busy_loop_s == 0.0
    worker.idle(False)
    assert spin.busy_loop_s == busy  # vLLM's own spin while there is work


def test_the_writer_polls_only_while_the_engine_is_idle():
    """While the engine steps, each step wakes the writer (upstream); polling then would take
    the GIL from the forward pass. The worker learns of idleness from each step's metadata."""
    worker = WorkerWake(f"idle-{uuid.uuid4().hex}", 0)
    assert worker.idle_now is False
    worker.idle(True)
    assert worker.idle_now is True
    worker.idle(False)
    assert worker.idle_now is False


def _idle_scheduler(monkeypatch, mode="push"):
    """The composed push (or pull) scheduler (connector.push_connector: vLLM's own, with our features), its engine
    core's wake channel stood in for (armed: a worker of ours has reached it): (scheduler, waits, lookups)."""
    from tests.support.connectors import pull_scheduler, push_scheduler

    waits, lookups = [], []

    def for_this_engine(vllm_config, engine_id):
        lookups.append(engine_id)
        return SimpleNamespace(armed=True, wait=waits.append)

    monkeypatch.setattr(EngineWake, "for_this_engine", for_this_engine)
    build = push_scheduler if mode == "push" else pull_scheduler
    return build(engine_id="decode-engine"), waits, lookups


def _step(scheduler, tokens):
    """One step's build_connector_meta (vLLM's, then ours); whether it was marked idle for the worker."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from connector.idle_wait import IDLE_ATTR

    output = SchedulerOutput.make_empty()
    output.total_num_scheduled_tokens = tokens
    return getattr(scheduler.build_connector_meta(output), IDLE_ATTR)


def _request(rid, status):
    return SimpleNamespace(request_id=rid, status=status, kv_transfer_params=None, num_computed_tokens=0)


def test_the_first_idle_step_after_a_busy_one_reaches_the_worker_before_the_engine_sleeps(monkeypatch):
    """IdleScheduler: an idle step right after a busy one never waits (the worker must see
    it to start polling); the next idle step may. The engine core's wake channel is looked up
    once, at the first step (its input thread starts after the scheduler is built)."""
    scheduler, waits, lookups = _idle_scheduler(monkeypatch)
    assert lookups == []  # not at construction
    scheduler.on_new_request(_request("d1", R))
    scheduler._push_registration_deadlines["d1"] = time.perf_counter() + 3600  # its registration awaits a push

    assert _step(scheduler, 5) is False and waits == []
    assert lookups == ["decode-engine"]
    assert _step(scheduler, 0) is True and waits == []  # first idle step: straight to the worker
    assert _step(scheduler, 0) is True and waits == [WAIT_CAP_S]  # then the engine sleeps
    assert _step(scheduler, 3) is False and _step(scheduler, 0) is True and waits == [WAIT_CAP_S]
    assert lookups == ["decode-engine"]  # once


def test_the_idle_decision_sees_the_requests_vllm_told_the_connector_of(monkeypatch):
    """IdleScheduler holds what vLLM's scheduler holds as vLLM tells the connector: from on_new_request to
    request_finished (vLLM's Scheduler.add_request and _free_request call them for every request)."""
    scheduler, waits, _ = _idle_scheduler(monkeypatch)
    scheduler.on_new_request(_request("d1", R))
    scheduler._push_registration_deadlines["d1"] = time.perf_counter() + 3600
    assert _step(scheduler, 0) is True and waits == []  # the first idle step
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S]  # d1 waits for pushed KV: the engine sleeps
    running = _request("d2", S.RUNNING)
    scheduler.on_new_request(running)
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S]  # d2 can run: no sleep
    scheduler.request_finished(running, [])
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S, WAIT_CAP_S]  # d2 gone: only waiting is left
    scheduler._push_registration_deadlines.pop("d1")
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S, WAIT_CAP_S, POLL_CAP_S]  # d1 awaits KV that is not pushed (a READ): short sleeps
    scheduler.request_finished(_request("d1", S.FINISHED_ABORTED), [])
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S, WAIT_CAP_S, POLL_CAP_S]  # nothing awaited: vLLM's loop blocks on its input


def test_a_pull_engine_sleeps_only_while_it_holds_nothing_but_finished_requests_blocks(monkeypatch):
    """PullScheduler: vLLM steps a pull engine as long as a finished request's blocks wait for a peer's READ (a
    conversation turn kept for read-back: 480 s). Those steps sleep; any request of its own steps as upstream does."""
    scheduler, waits, _ = _idle_scheduler(monkeypatch, "pull")
    reading = _request("d1", R)
    scheduler.on_new_request(reading)
    _step(scheduler, 0), _step(scheduler, 0)
    assert waits == []  # its READ completes silently: vLLM's steps find it
    scheduler.request_finished(_request("d1", S.FINISHED_STOPPED), [])
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S]  # only kept blocks (or nothing) left: sleep, any engine input wakes it
    scheduler.on_new_request(_request("d2", S.WAITING))
    _step(scheduler, 0)
    assert waits == [WAIT_CAP_S]


class _EngineCore:
    """Base for stand-ins of vLLM's engine core process: only what the wake channel reaches, its input queue and
    the thread that feeds it (vLLM's runs ``process_input_sockets``; this one waits until stopped)."""

    def __init__(self):
        self.input_queue = queue.Queue()
        self._stop = threading.Event()

    def process_input_sockets(self, *args):
        self._stop.wait()


@pytest.fixture
def engine_core():
    """A running engine core of vLLM's class (EngineCoreProc), or of another class: (make, cores)."""
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCoreProc

    kinds = {"core": type("Core", (_EngineCore, EngineCoreProc), {}),
             "dp_core": type("DPCore", (_EngineCore, DPEngineCoreProc), {}), "other": _EngineCore}
    started = []

    def make(kind):
        core = kinds[kind]()
        thread = threading.Thread(target=core.process_input_sockets, args=(None, None, b"", threading.Event()),
                                  daemon=True)
        thread.start()
        started.append((core, thread))
        return core

    yield make
    for core, thread in started:
        core._stop.set()
        thread.join()


def test_the_engine_core_is_the_owner_of_the_thread_feeding_its_input_queue(engine_core):
    """vLLM hands the connector no reference to its engine core: idle_wait.engine_core() finds it as the owner
    of the thread running its input loop, as vLLM's EngineCoreProc starts it; None where there is none."""
    import inspect

    from vllm.v1.engine.core import EngineCoreProc

    from connector.idle_wait import engine_core as find

    assert "target=self.process_input_sockets," in inspect.getsource(EngineCoreProc.__init__)
    assert find() is None  # this process has no engine core
    engine_core("other")  # a thread whose target's owner is not vLLM's engine core
    assert find() is None
    core = engine_core("core")
    assert find() is core


@pytest.mark.parametrize("max_concurrent_batches, sleeps", [(1, True), (2, False), (3, False)])
def test_no_idle_wait_where_the_engine_runs_a_batch_queue(engine_core, max_concurrent_batches, sleeps):
    """A GPU engine schedules with async scheduling (a batch queue of 2) by default: the next step is scheduled before
    the last one's output, landed KV included, is read, so a sleep there would only delay the KV. The engine core
    is vLLM's, found as the owner of its input thread; the config is the GPU's setting."""
    core = engine_core("core")
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
                             max_concurrent_batches=max_concurrent_batches)
    wake = EngineWake.for_this_engine(config, f"test-{uuid.uuid4().hex}")
    assert (wake is not None) is sleeps
    if wake is not None:  # hooked into that engine core's input queue
        core.input_queue.put_nowait("input")
        assert wake.wait(5) is True


def test_no_idle_wait_with_data_parallel(engine_core):
    """Data parallel ranks step together: an engine core of vLLM's DPEngineCoreProc never sleeps."""
    engine_core("dp_core")
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
                             max_concurrent_batches=1)
    assert EngineWake.for_this_engine(config, f"test-{uuid.uuid4().hex}") is None
