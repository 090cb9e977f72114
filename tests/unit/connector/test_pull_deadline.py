"""connector.pull_deadline: a READ past its deadline is cancelled and reported failed (vLLM then
recomputes), unless NIXL cannot cancel it; step by step over vLLM's worker bookkeeping (the real
vLLM and NIXL calls are the seams'; test_pull runs the whole with a READ that is never posted)."""

from __future__ import annotations

import queue
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest

from connector import pull_deadline
from connector.pull_deadline import ReadDeadline

TIMEOUT_S = 10.0


class Nixl:
    def __init__(self, cancellable: list[bool]):
        self.cancellable, self.released = list(cancellable), []

    def release_xfer_handle(self, handle):
        if not (self.cancellable.pop(0) if self.cancellable else True):
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(handle)


class VllmPullWorker:
    """What ReadDeadline relies on of vLLM 0.32's pull worker: a READ leaves its handles in
    _recving_transfers; a receive put on _failed_recv_reqs is reported failed by the next
    get_transfer_results, with the finished ones (the step's results are returned, not kept)."""

    def __init__(self, nixl: Nixl):
        self._recving_transfers = defaultdict(list)
        self._failed_recv_reqs: queue.Queue = queue.Queue()
        self.nixl_wrapper, self.failed, self._landed = nixl, [], set()

    def _read_blocks_for_req(self, req_id, meta):
        self._recving_transfers[req_id].append(f"{req_id}-handle")

    def get_transfer_results(self):
        done, self._landed = self._landed, set()
        while not self._failed_recv_reqs.empty():
            req_id = self._failed_recv_reqs.get_nowait()
            self.failed.append(req_id)
            done.add(req_id)
        return SimpleNamespace(finished_sending=set(), finished_recving=done)

    def land(self, req_id):  # the READ completed: vLLM pops it at the next get_transfer_results
        self._recving_transfers.pop(req_id)
        self._landed.add(req_id)


class Worker(VllmPullWorker):
    """The fake above as the host, with the deadline composed in as connector.pull_connector.PullWorker composes
    it: each hook calls the feature where PullWorker does, around vLLM's (the host's) own."""

    def __init__(self, nixl: Nixl, timeout_s: float | None = TIMEOUT_S, reads_cancel: bool = True):
        super().__init__(nixl)
        self._deadline = ReadDeadline(self, timeout_s, reads_cancel)

    def _read_blocks_for_req(self, req_id, meta):
        if not self._deadline.may_read(req_id):
            return None
        return super()._read_blocks_for_req(req_id, meta)

    def get_transfer_results(self):
        self._deadline.cancel_late_reads(time.monotonic())
        results = super().get_transfer_results()
        self._deadline.reported(results)
        return results


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(pull_deadline.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(pull_deadline, "injected_fault", lambda: None)
    return now


# (seconds after posting, NIXL can cancel each time asked, READ lands first?, expected: reported failed, handle freed)
CASES = [
    pytest.param([5.0], [], False, [], [], id="before-the-deadline-nothing-happens"),
    pytest.param([5.0, 11.0], [], True, [], [], id="a-read-that-landed-is-left-to-vllm"),
    pytest.param([11.0], [True], False, ["r1"], ["r1-handle"], id="past-the-deadline-cancelled-and-failed"),
    pytest.param([11.0, 12.0], [False, False], False, [], [], id="not-cancellable-keeps-its-blocks"),
    pytest.param([11.0, 12.0], [False, True], False, ["r1"], ["r1-handle"], id="cancelled-at-a-later-step"),
]


@pytest.mark.parametrize("steps, cancellable, lands, failed, released", CASES)
def test_a_late_read_is_cancelled_and_failed_once_nixl_lets_go(clock, steps, cancellable, lands, failed, released):
    worker = Worker(Nixl(cancellable))
    worker._read_blocks_for_req("r1", meta=None)
    posted = clock[0]
    for i, after in enumerate(steps):
        clock[0] = posted + after
        if lands and i == len(steps) - 1:
            worker.land("r1")
        worker.get_transfer_results()
    assert worker.failed == failed
    assert worker.nixl_wrapper.released == released
    assert ("r1" in worker._recving_transfers) == (not failed and not lands)


@pytest.mark.parametrize("backends, lands", [(["LIBFABRIC"], False), (["LIBFABRIC"], True), (["UCX", "LIBFABRIC"], False)])
def test_a_late_read_on_a_backend_that_cannot_cancel_it_keeps_its_blocks_until_nixl_is_done(clock, backends, lands):
    """NIXL's LIBFABRIC backend answers a release of a posted READ with success and does not cancel it: freed,
    its blocks would be recomputed into or reused while the READ can still land (silent corruption the checksums
    never see: they check completed READs)."""
    from connector.nixl_progress import reads_cancel

    worker = Worker(Nixl([True, True]), reads_cancel=reads_cancel(backends))  # NIXL would say yes: it must not be asked
    worker._read_blocks_for_req("r1", meta=None)
    clock[0] += TIMEOUT_S + 1
    worker.get_transfer_results()
    clock[0] += 60
    if lands:
        worker.land("r1")
    worker.get_transfer_results()
    assert worker.nixl_wrapper.released == [] and worker.failed == []
    assert ("r1" in worker._recving_transfers) is not lands


def test_a_read_that_is_never_posted_fails_at_its_deadline(clock, monkeypatch):
    monkeypatch.setattr(pull_deadline, "injected_fault", lambda: "stall-read")
    worker = Worker(Nixl([]))
    worker._read_blocks_for_req("r1", meta=None)
    assert "r1" not in worker._recving_transfers  # nothing posted
    clock[0] += TIMEOUT_S - 1
    assert worker.get_transfer_results().finished_recving == set()
    clock[0] += 2
    assert worker.get_transfer_results().finished_recving == {"r1"} and worker.failed == ["r1"]
    clock[0] += 60
    assert worker.get_transfer_results().finished_recving == set(), "reported once"


def test_without_a_deadline_reads_are_not_clocked(clock):
    worker = Worker(Nixl([]), timeout_s=None)
    worker._read_blocks_for_req("r1", meta=None)
    clock[0] += 3600
    worker.get_transfer_results()
    assert worker.failed == [] and "r1" in worker._recving_transfers
