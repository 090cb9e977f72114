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
    idle_wait_s,
    ships_work,
    stack_self,
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


def _meta(**fields):
    base = dict(reqs_to_recv={}, reqs_to_send={}, reqs_not_processed=set(), push_registrations={},
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


def test_a_worker_after_an_idle_step_waits_on_its_rpc_socket_instead_of_spinning():
    spin = SimpleNamespace(busy_loop_s=1.0)
    rpc_reader = SimpleNamespace(rpc_broadcast_mq=SimpleNamespace(_spin_condition=spin))

    class WorkerProc:  # vLLM's multiprocessing executor calls the worker from inside its RPC loop
        rpc_broadcast_mq = rpc_reader.rpc_broadcast_mq

        def run(self, worker, idle):
            worker.idle(idle)

    worker, proc = WorkerWake(f"spin-{uuid.uuid4().hex}", 0), WorkerProc()
    proc.run(worker, True)
    assert spin.busy_loop_s == 0.0
    proc.run(worker, False)
    assert spin.busy_loop_s == 1.0  # vLLM's own spin while there is work


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


def test_stack_self_finds_the_nearest_matching_caller():
    class Outer:
        def call(self, fn):
            return fn()

    outer = Outer()
    assert outer.call(lambda: stack_self(lambda obj: isinstance(obj, Outer))) is outer
    assert stack_self(lambda obj: isinstance(obj, WorkerWake)) is None


def test_the_writer_polls_only_while_the_engine_is_idle():
    """While the engine steps, each step wakes the writer (upstream); polling then would take
    the GIL from the forward pass. The worker learns of idleness from each step's metadata."""
    worker = WorkerWake(f"idle-{uuid.uuid4().hex}", 0)
    assert worker.idle_now is False
    worker.idle(True)
    assert worker.idle_now is True
    worker.idle(False)
    assert worker.idle_now is False


def test_the_first_idle_step_after_a_busy_one_reaches_the_worker_before_the_engine_sleeps(monkeypatch):
    """IdleScheduler: an idle step right after a busy one never waits (the worker must see
    it to start polling); the next idle step may. vLLM's own metadata building below ours
    is replaced by an empty metadata (this test is about what ours adds)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput

    from connector.idle_wait import IDLE_ATTR, IdleScheduler

    below = next(c for c in IdleScheduler.__mro__[1:] if "build_connector_meta" in c.__dict__)
    monkeypatch.setattr(below, "build_connector_meta", lambda self, output: NixlConnectorMetadata())
    waits = []
    scheduler = IdleScheduler.__new__(IdleScheduler)  # vLLM builds it; only what build_connector_meta reads
    scheduler._wake = SimpleNamespace(armed=True, wait=waits.append)
    scheduler._scheduler = SimpleNamespace(requests={"d1": SimpleNamespace(status=R)})
    scheduler._push_registration_deadlines = {"d1": 1.0}
    scheduler._finished_request_blocks = {}

    def step(tokens):
        output = SchedulerOutput.make_empty()
        output.total_num_scheduled_tokens = tokens
        return getattr(scheduler.build_connector_meta(output), IDLE_ATTR)

    assert step(5) is False and waits == []
    assert step(0) is True and waits == []  # first idle step: straight to the worker
    assert step(0) is True and waits == [WAIT_CAP_S]  # then the engine sleeps
    assert step(3) is False and step(0) is True and waits == [WAIT_CAP_S]


@pytest.mark.parametrize("max_concurrent_batches, sleeps", [(1, True), (2, False), (3, False)])
def test_no_idle_wait_where_the_engine_runs_a_batch_queue(max_concurrent_batches, sleeps):
    """A GPU engine schedules with async scheduling (a batch queue of 2) by default: the next step is scheduled before
    the last one's output, landed KV included, is read, so a sleep there would only delay the KV. The engine core
    is vLLM's, found up the stack as in its constructor; the config is the GPU's setting."""
    from vllm.v1.engine.core import EngineCoreProc

    core = EngineCoreProc.__new__(EngineCoreProc)  # only what the wake channel hooks: its input queue
    core.input_queue = queue.Queue()
    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
                             max_concurrent_batches=max_concurrent_batches)

    def scheduler_built_by(self):  # noqa: ARG001 - `self` is what stack_self finds, as in vLLM's EngineCore
        return EngineWake.for_this_engine(config, f"test-{uuid.uuid4().hex}")

    assert (scheduler_built_by(core) is not None) is sleeps
