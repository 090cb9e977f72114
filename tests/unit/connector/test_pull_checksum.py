"""connector.pull_checksum: in pull, prefill's sums ride with the request and decode checks its READ.

The scheduler half runs on a stand-in for vLLM's pull scheduler that keeps only the order vLLM calls
it in (build_connector_meta, the step, request_finished, update_connector_output); the worker half
runs on test_kv_checksum's real KV tensors, the READ being a byte copy of prefill's blocks. The
stand-ins are the features' hosts; ``Scheduler`` and ``Worker`` compose ``PullSumsScheduler`` and
``PullSumsWorker`` with them as ``connector.pull_connector``'s classes do."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from connector import faults, kv_checksum
from connector.params import KEEP_HISTORY_KEY, KV_SUMS_KEY, REUSE_REPORT_KEY
from connector.pull_checksum import (
    EXPECTED_ATTR,
    READ_BACK,
    SUM_BLOCKS_ATTR,
    PulledSums,
    PullSumsScheduler,
    PullSumsWorker,
    expected_for,
)
from tests.support.kv_caches import BLOCKS, Upstream, chunks_moved

PREFILL = {"do_remote_decode": True}
KEEPING = {"do_remote_prefill": True, KEEP_HISTORY_KEY: True}  # a decode leg that keeps its blocks for the next turn


class UpstreamScheduler:
    """The calls PullSumsScheduler is composed around, as vLLM's pull scheduler answers them."""

    block_size = 16

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return SimpleNamespace()

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        if params.get("do_remote_decode") or params.get(KEEP_HISTORY_KEY):
            return True, {"do_remote_prefill": bool(params.get("do_remote_decode")), "remote_block_ids": list(block_ids[0])}
        return False, None

    def update_connector_output(self, connector_output):
        pass


@dataclass
class Scheduler:
    """vLLM's pull scheduler (the stand-in: the host) with the checksums feature composed in. Each hook calls
    the feature and the host in the order ``connector.pull_connector.PullScheduler``'s does (its other
    features left out)."""

    host: UpstreamScheduler
    sums: PullSumsScheduler

    @classmethod
    def of(cls, checksums: bool = True) -> Scheduler:
        host = UpstreamScheduler()
        return cls(host, PullSumsScheduler(host, checksums))

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.sums.allocating(request)
        self.host.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = self.host.build_connector_meta(scheduler_output)
        self.sums.built(meta, scheduler_output)
        return meta

    def update_connector_output(self, connector_output):
        self.host.update_connector_output(connector_output)
        self.sums.output(connector_output)

    def request_finished(self, request, block_ids):
        prefill_leg = self.sums.finishing(request)
        delay, params = self.host.request_finished(request, block_ids)
        self.sums.finished(request, prefill_leg, delay, params)
        return delay, params


def _request(rid, prompt_tokens, params):
    return SimpleNamespace(request_id=rid, prompt_token_ids=[1] * prompt_tokens, kv_transfer_params=dict(params))


def _step(new=(), cached=(), resumed=()):
    """SchedulerOutput: new = (req id, block ids, computed, scheduled); cached = (req id, new block ids | None, computed, scheduled)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[None if b is None else (list(b),) for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached]),
        num_scheduled_tokens={r: n for r, *_, n in [*new, *cached]})


@pytest.mark.parametrize("steps, summed", [
    # The whole prompt in one step: its blocks are summed after that step's forward pass.
    ([_step(new=[("p", [4, 5, 6], 0, 300)])], [{"p": [4, 5, 6]}]),
    # Chunked: nothing until the chunk that completes the prompt; blocks added on the way are included.
    ([_step(new=[("p", [4, 5], 0, 256)]), _step(cached=[("p", [6], 256, 44)])], [{}, {"p": [4, 5, 6]}]),
    # Preempted and resumed: vLLM sends the whole (new) block list.
    ([_step(new=[("p", [4, 5], 0, 256)]), _step(cached=[("p", [9, 8, 7], 0, 300)], resumed=["p"])],
     [{}, {"p": [9, 8, 7]}]),
    # A step that schedules the leg without new blocks still completes it.
    ([_step(new=[("p", [4, 5, 6], 0, 200)]), _step(cached=[("p", None, 200, 100)])], [{}, {"p": [4, 5, 6]}]),
])
def test_prefill_workers_are_told_to_sum_a_legs_blocks_in_the_step_its_prompt_completes(steps, summed):
    scheduler = Scheduler.of()
    scheduler.update_state_after_alloc(_request("p", 300, PREFILL), None, 0)
    for step, expected in zip(steps, summed):
        assert getattr(scheduler.build_connector_meta(step), SUM_BLOCKS_ATTR, {}) == expected


def test_requests_that_are_no_prefill_legs_are_not_summed_nor_when_checksums_are_off():
    scheduler = Scheduler.of()
    scheduler.update_state_after_alloc(_request("plain", 300, {}), None, 0)
    off = Scheduler.of(checksums=False)
    off.update_state_after_alloc(_request("p", 300, PREFILL), None, 0)
    for s, rid in ((scheduler, "plain"), (off, "p")):
        assert not hasattr(s.build_connector_meta(_step(new=[(rid, [1, 2, 3], 0, 300)])), SUM_BLOCKS_ATTR)


def test_the_sums_land_in_the_params_request_finished_returned_in_the_same_step():
    scheduler = Scheduler.of()
    request = _request("p", 300, PREFILL)
    scheduler.update_state_after_alloc(request, None, 0)
    scheduler.build_connector_meta(_step(new=[("p", [4, 5, 6], 0, 300)]))
    _, params = scheduler.request_finished(request, ([4, 5, 6],))
    sums = {0: np.arange(6).reshape(2, 3), 1: np.arange(6, 12).reshape(2, 3)}
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=PulledSums(
        {"p": {0: sums[0]}}, (2, 16, 1)).aggregate(PulledSums({"p": {1: sums[1]}}, (2, 16, 1)))))
    payload = json.loads(json.dumps(params[KV_SUMS_KEY]))  # JSON-safe: it travels in an HTTP body too
    assert (payload["tp"], payload["block_size"], payload["physical_per_logical"], payload["regions"]) == (2, 16, 1, 2)
    for rank in (0, 1):
        got, why_not = expected_for(payload, tp=2, rank=rank, block_size=16, physical_per_logical=1, offered=3, blocks=3,
                                     kv_heads=2)
        assert why_not is None and (got == sums[rank]).all()
    # A later step's sums never reach an earlier step's params (their output was sent without them).
    scheduler.build_connector_meta(_step())
    late = Scheduler.of()
    late.update_state_after_alloc(_request("q", 300, PREFILL), None, 0)
    _, late_params = late.request_finished(_request("q", 300, PREFILL), ([1],))
    late.build_connector_meta(_step())
    late.update_connector_output(SimpleNamespace(kv_connector_worker_meta=PulledSums({"q": {0: sums[0]}})))
    assert KV_SUMS_KEY not in late_params


def test_a_decode_leg_hands_prefills_sums_to_its_workers_with_the_read():
    scheduler = Scheduler.of()
    payload = {"tp": 1, "ranks": ["AAAAAAAAAAA="]}
    scheduler.update_state_after_alloc(_request("d", 300, {"do_remote_prefill": True, KV_SUMS_KEY: payload}), None, 0)
    assert getattr(scheduler.build_connector_meta(_step()), EXPECTED_ATTR) == {"d": payload}
    assert not hasattr(scheduler.build_connector_meta(_step()), EXPECTED_ATTR)  # once


@pytest.mark.parametrize("layout, offered, blocks, columns", [
    ((1, 16, 1), 3, 3, [0, 1, 2]),
    ((1, 16, 1), 3, 2, [1, 2]),  # the reader had the first block cached: the last two pair
    ((1, 16, 1), 2, 1, [1]),  # a history cut to its verified prefix (two blocks), the first one cached
    ((1, 16, 1), 3, 4, "4 blocks read of 3 offered, 3 summed"),
    ((1, 16, 1), 4, 2, "2 blocks read of 4 offered, 3 summed"),
    ((3, 16, 1), 3, 3, "no sums from sender rank(s) [1, 2]"),  # a TP 3 sender: all three ranks' sums add up
    ((1, 32, 1), 3, 3, "block size"),
    ((1, 16, 1, 4), 3, 3, "not 2 regions of 4 chunk(s)"),  # a payload that does not parse: nothing checked
])
def test_a_reader_checks_only_where_its_blocks_pair_with_the_senders(layout, offered, blocks, columns):
    sums = np.arange(6, dtype=np.int64).reshape(2, 3)
    payload = PulledSums({"r": {0: sums}}, layout[:3], parts=(layout[3:] or (1,))[0]).payload("r")
    got, reason = expected_for(payload, tp=1, rank=0, block_size=16, physical_per_logical=1, offered=offered,
                               blocks=blocks, kv_heads=3)
    if isinstance(columns, list):
        assert reason is None and (got == sums[:, columns]).all()
    else:
        assert got is None and columns in reason


def _finish_step(scheduler, request, blocks, sums):
    """The step a request finishes in: request_finished, then that step's worker output."""
    _, params = scheduler.request_finished(request, (list(blocks),))
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=sums))
    return params


def test_a_decode_leg_keeping_its_history_sums_its_prompts_whole_blocks_and_its_response_carries_them():
    scheduler, request = Scheduler.of(), _request("d", 40, KEEPING)  # 40 tokens: two whole blocks and a partial one
    scheduler.update_state_after_alloc(request, None, 39)
    # The READ landed 39 tokens; the step that computes the last one completes the prompt.
    assert getattr(scheduler.build_connector_meta(_step(new=[("d", [7, 8, 9], 39, 1)])), SUM_BLOCKS_ATTR) == {"d": [7, 8]}
    sums = np.arange(4, dtype=np.int64).reshape(2, 2)
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=PulledSums({"d": {0: sums}}, (1, 16, 1))))
    # Decoding steps: nothing more to sum.
    assert not hasattr(scheduler.build_connector_meta(_step(cached=[("d", None, 40, 1)])), SUM_BLOCKS_ATTR)
    params = _finish_step(scheduler, request, [7, 8, 9, 10], None)
    got, why_not = expected_for(params[KV_SUMS_KEY], tp=1, rank=0, block_size=16, physical_per_logical=1, offered=2,
                                blocks=2, kv_heads=3)
    assert why_not is None and (got == sums).all()


def test_a_keeping_leg_that_finishes_in_the_step_its_prompt_completes_gets_that_steps_sums():
    scheduler, request = Scheduler.of(), _request("d", 40, KEEPING)
    scheduler.update_state_after_alloc(request, None, 39)
    scheduler.build_connector_meta(_step(new=[("d", [7, 8, 9], 39, 1)]))
    params = _finish_step(scheduler, request, [7, 8, 9], PulledSums({"d": {0: np.ones((2, 2), np.int64)}}, (1, 16, 1)))
    assert KV_SUMS_KEY in params


def test_a_keeping_leg_preempted_and_recomputed_is_summed_again_and_its_old_sums_dropped():
    scheduler, request = Scheduler.of(), _request("d", 40, KEEPING)
    scheduler.update_state_after_alloc(request, None, 39)
    scheduler.build_connector_meta(_step(new=[("d", [7, 8, 9], 39, 1)]))
    old = PulledSums({"d": {0: np.zeros((2, 2), np.int64)}}, (1, 16, 1))
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=old))
    resumed = scheduler.build_connector_meta(_step(cached=[("d", [3, 4, 5], 0, 45)], resumed=["d"]))
    assert getattr(resumed, SUM_BLOCKS_ATTR) == {"d": [3, 4]}
    new = PulledSums({"d": {0: np.ones((2, 2), np.int64)}}, (1, 16, 1))
    params = _finish_step(scheduler, request, [3, 4, 5], new)
    assert params[KV_SUMS_KEY] == new.payload("d")


def test_a_prefill_leg_reading_history_back_hands_decodes_sums_to_its_workers_and_reports_a_mismatch():
    scheduler = Scheduler.of()
    history = PulledSums({"d": {0: np.ones((2, 2), np.int64)}}, (1, 16, 1)).payload("d")
    request = _request("p", 60, {**PREFILL, "remote_block_ids": [[7, 8]], KV_SUMS_KEY: history})
    scheduler.update_state_after_alloc(request, None, 32)
    assert getattr(scheduler.build_connector_meta(_step()), EXPECTED_ATTR) == {"p": {**history, READ_BACK: True}}
    # Its workers found the READ wrong: prefill recomputed the history, and its response says so.
    scheduler.update_connector_output(SimpleNamespace(kv_connector_worker_meta=PulledSums(history_mismatched={"p"})))
    scheduler.build_connector_meta(_step(new=[("p", [1, 2, 3, 4], 0, 60)]))
    params = _finish_step(scheduler, request, [1, 2, 3, 4], None)
    assert params[REUSE_REPORT_KEY]["reason"] == "kv_mismatch"
    clean = Scheduler.of()
    clean.update_state_after_alloc(_request("q", 60, PREFILL), None, 0)
    assert REUSE_REPORT_KEY not in _finish_step(clean, _request("q", 60, PREFILL), [1, 2, 3, 4], None)


# --------------------------------------------------------------------------- workers over real KV


class UpstreamPullWorker(Upstream):
    def __init__(self, engine_id, seed, **tp):
        super().__init__(engine_id, seed, **tp)
        self.block_size = 16

    def start_load_kv(self, metadata):
        for meta in metadata.reqs_to_recv.values():
            meta.local_physical_block_ids = meta.local_block_ids


@dataclass
class Worker:
    """vLLM's pull worker (the stand-in: the host) with the checksums feature composed in. Each hook calls
    the feature and the host in the order ``connector.pull_connector.PullWorker``'s does (its READ deadline
    left out)."""

    host: UpstreamPullWorker
    checks: PullSumsWorker

    @classmethod
    def of(cls, engine_id: str, seed: int, checksums: bool = True, peer_tp: int = 1, **tp) -> Worker:
        host = UpstreamPullWorker(engine_id, seed, **tp)
        return cls(host, PullSumsWorker(host, checksums, peer_tp))

    def start_load_kv(self, metadata):
        self.checks.loading(metadata)
        self.host.start_load_kv(metadata)

    def _pop_done_transfers(self, transfers):
        done, failed = self.host._pop_done_transfers(transfers)
        return self.checks.landed(transfers, done, failed)

    def build_connector_worker_meta(self):
        return self.checks.worker_meta()


def _pull(prefill, decode, prefill_blocks=(1, 2, 3), decode_blocks=(7, 6, 5), read_back=False):
    """One pull: prefill sums after its forward pass, the sums travel, decode READs (copies) and checks.
    With ``read_back`` the other way round too: ``prefill`` is the decode engine that kept a turn's blocks,
    ``decode`` the prefill engine reading them back."""
    prefill.start_load_kv(SimpleNamespace(reqs_to_recv={}, **{SUM_BLOCKS_ATTR: {"p": list(prefill_blocks)}}))
    payload = prefill.build_connector_worker_meta().payload("p")
    payload = {**payload, READ_BACK: True} if read_back else payload
    reading = SimpleNamespace(local_block_ids=[list(decode_blocks)],
                              remote=SimpleNamespace(request_id="p", block_ids=[list(prefill_blocks)]))
    decode.start_load_kv(SimpleNamespace(reqs_to_recv={"d": reading}, **{EXPECTED_ATTR: {"d": payload}}))
    for mine, theirs in zip(prefill.host.device_kv_caches.values(), decode.host.device_kv_caches.values()):
        for local, remote in zip(prefill_blocks[len(prefill_blocks) - len(decode_blocks):], decode_blocks):
            theirs[:, remote] = mine[:, local]
    decode.host._recving_metadata["d"], decode.host._recving_transfers["d"] = reading, []
    done, failed = decode._pop_done_transfers(decode.host._recving_transfers)
    return done, sorted(failed)


def test_a_clean_read_is_done_and_a_read_that_landed_wrong_is_failed_and_counted(monkeypatch, tmp_path):
    sent = []
    monkeypatch.setattr(kv_checksum, "send_stamps", sent.append)
    assert _pull(Worker.of("prefill", 1), Worker.of("decode", 2)) == ({"d"}, [])
    first_block_cached = (6, 5)
    assert _pull(Worker.of("prefill", 1), Worker.of("decode", 2), decode_blocks=first_block_cached) == ({"d"}, [])
    fault = tmp_path / "fault"
    fault.write_text("flip")
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(fault))
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    assert _pull(Worker.of("prefill", 1), Worker.of("decode", 2)) == (set(), ["d"])
    assert [(s.request_id, s.failed) for s in sent] == [("d", "kv_mismatch")]


def test_a_history_read_back_that_landed_wrong_is_failed_and_reported_to_prefills_scheduler(monkeypatch, tmp_path):
    sent = []
    monkeypatch.setattr(kv_checksum, "send_stamps", sent.append)
    assert _pull(Worker.of("decode", 1), Worker.of("prefill", 2), read_back=True) == ({"d"}, [])
    fault = tmp_path / "fault"
    fault.write_text("flip-history")
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(fault))
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    assert _pull(Worker.of("decode", 1), Worker.of("prefill", 2)) == ({"d"}, [])  # a prompt's READ: not this fault's
    reader = Worker.of("prefill", 2)
    assert _pull(Worker.of("decode", 1), reader, read_back=True) == (set(), ["d"])
    assert reader.build_connector_worker_meta().history_mismatched == {"d"}
    assert sent == []  # not decode's prefill="kv_mismatch": the turn's report says it


def test_decode_reads_unchecked_where_prefill_sent_no_sums_it_can_pair_and_says_so_once(caplog):
    decode = Worker.of("decode", 2)
    decode.host.world_size = 3
    payload = PulledSums({"p": {0: np.zeros((6, BLOCKS), dtype=np.int64)}}, (1, 16, 1)).payload("p")
    reading = SimpleNamespace(local_block_ids=[[1, 2]], remote=SimpleNamespace(request_id="p", block_ids=[[1, 2]]))
    with caplog.at_level(logging.WARNING, logger="vllm.rendezvous"):
        for rid in ("d1", "d2"):
            decode.start_load_kv(SimpleNamespace(reqs_to_recv={rid: reading}, **{EXPECTED_ATTR: {rid: payload}}))
    assert not decode.checks._expected()
    assert len([r for r in caplog.records if "not checked" in r.getMessage()]) == 1
    decode.host._recving_metadata["d1"], decode.host._recving_transfers["d1"] = reading, []
    assert decode._pop_done_transfers(decode.host._recving_transfers) == ({"d1"}, set())


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (4, 1), (1, 2), (1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize("corrupt", [None, 0, -1])
def test_between_different_tp_sizes_each_reader_rank_checks_exactly_its_share(prefill_tp, decode_tp, corrupt):
    """Pull between different TP sizes: prefill's ranks sum each block in as many chunks as decode's TP
    has ranks a block of theirs (they know it from their config); a decode rank READs (copies, below,
    as vLLM's descriptors move them) the KV-head chunks it holds from the prefill ranks that hold them,
    and checks them against those ranks' sums. A byte wrong in one decode rank's share fails that READ
    and no other."""
    prefills = [Worker.of("prefill", 10 + r, peer_tp=decode_tp, tp_rank=r, world_size=prefill_tp)
                for r in range(prefill_tp)]
    decodes = [Worker.of("decode", 20 + r, tp_rank=r, world_size=decode_tp) for r in range(decode_tp)]
    summed = None
    for prefill in prefills:
        prefill.start_load_kv(SimpleNamespace(reqs_to_recv={}, **{SUM_BLOCKS_ATTR: {"p": [1, 2, 3]}}))
        mine = prefill.build_connector_worker_meta()
        summed = mine if summed is None else summed.aggregate(mine)
    payload = json.loads(json.dumps(summed.payload("p")))
    wrong = None if corrupt is None else range(decode_tp)[corrupt]
    for rank, decode in enumerate(decodes):
        reading = SimpleNamespace(local_block_ids=[[7, 6, 5]], remote=SimpleNamespace(request_id="p", block_ids=[[1, 2, 3]]))
        decode.start_load_kv(SimpleNamespace(reqs_to_recv={"d": reading}, **{EXPECTED_ATTR: {"d": payload}}))
        for prefill in prefills:
            if moved := chunks_moved(prefill_tp, prefill.host.tp_rank, decode_tp, rank):
                for mine, src in zip(decode.host.device_kv_caches.values(), prefill.host.device_kv_caches.values()):
                    mine[:, [7, 6, 5], moved[1]] = src[:, [1, 2, 3], moved[0]]
        if rank == wrong:
            next(iter(decode.host.device_kv_caches.values()))[0, 6, 0] += 1.0
        decode.host._recving_metadata["d"], decode.host._recving_transfers["d"] = reading, []
        done, failed = decode._pop_done_transfers(decode.host._recving_transfers)
        assert (done, sorted(failed)) == ((set(), ["d"]) if rank == wrong else ({"d"}, []))
