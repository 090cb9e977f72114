"""connector.kv_checksum: prefill's sums of what it WRITEs against what lands in decode's blocks.

Two workers over real KV tensors, laid out as vLLM registers them with NIXL (one descriptor per
layer region and block); the stand-in for vLLM (``Upstream``, the feature's host) copies bytes as a
WRITE would, so what is checked is the connector's own logic: which blocks it sums, how the sums
travel, what a mismatch does to the receive. ``Worker`` composes the ``KvChecksums`` feature with
its host as ``connector.push_connector.PushWorker`` does."""

from __future__ import annotations

import queue
from dataclasses import dataclass
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

from connector import faults, kv_checksum, kv_digest
from connector.kv_checksum import KvChecksums, KvSumsCheck, mismatches
from connector.side_notifs import KV_SUMS_NOTIF, SideRoutingQueue
from tests.support.kv_caches import BLOCK_ELEMS, BLOCKS, KV_HEADS, LAYERS, Upstream, chunks_moved


@dataclass
class Worker:
    """vLLM's push worker (the stand-in: the host) with the checksums feature composed in. Each hook calls
    the feature and the host in the order ``connector.push_connector.PushWorker``'s does (its other
    features left out)."""

    host: Upstream
    checks: KvChecksums

    @classmethod
    def of(cls, engine_id: str, seed: int, checksums: bool = True, **tp) -> Worker:
        host = Upstream(engine_id, seed, **tp)
        return cls(host, KvChecksums(host, checksums))

    def _xfer_blocks_for_req(self, req_id, meta):  # prefill's writer thread: the sums, then the WRITE
        if not self.checks.writing(req_id, meta):
            return None
        return self.host._xfer_blocks_for_req(req_id, meta)

    def _get_new_notifs(self):
        self.checks.take_notifs()
        return self.host._get_new_notifs()

    def _pop_done_transfers(self, transfers):
        done, failed = self.host._pop_done_transfers(transfers)
        return self.checks.landed(transfers, done, failed)

    def build_connector_worker_meta(self):
        return self.checks.worker_meta(None)  # no reuse offers here (PushWorker passes push_reuse's)

    def _do_send_reg_notif(self, req_id, reg_data):
        self.checks.registering(req_id, reg_data)
        return self.host._do_send_reg_notif(req_id, reg_data)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        self.checks.on_registration(notif)
        self.host._handle_push_reg_notif(notif)


def _pair():
    prefill, decode = Worker.of("prefill", seed=1), Worker.of("decode", seed=2)
    prefill.host.peer = decode.host
    return prefill, decode


def _push(prefill, decode, request_id="rdv-1", local=(1, 2, 3, 4), remote=(6, 5, 0)):
    """One push: prefill holds ``local`` (decode had the first block cached, so it gets the last 3)."""
    meta = SimpleNamespace(local_physical_block_ids=(list(local),),
                           remote=SimpleNamespace(engine_id="decode", request_id=request_id, block_ids=(list(remote),)))
    prefill._xfer_blocks_for_req("prefill-id", meta)
    for agent, notif in prefill.host.notifs_sent:
        assert agent == "decode-agent-0"
        decode.host._pending_completion_notifs.put(notif)
    prefill.host.notifs_sent.clear()
    decode.host._recving_metadata[request_id] = SimpleNamespace(local_block_ids=[list(remote)],
                                                                local_physical_block_ids=(list(remote),), remote=None)
    decode.host._recving_transfers[request_id] = []
    decode._get_new_notifs()
    return _pop(decode)


def _pop(worker) -> tuple[set, list]:
    """The receives vLLM's ``get_transfer_results`` is told are done, and failed (it invalidates their blocks)."""
    done, failed = worker._pop_done_transfers(worker.host._recving_transfers)
    return done, sorted(failed)


@pytest.mark.parametrize(
    "expected, got, wrong",
    [
        (np.zeros((2, 3)), np.zeros((2, 3)), []),
        (np.zeros((2, 3)), np.array([[0, 0, 0], [0, 7, 0]]), [(1, 1)]),
        (np.zeros((2, 3)), np.zeros((2, 2)), [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]),  # shapes differ: all
    ],
)
def test_mismatches_name_each_region_and_block_that_differs(expected, got, wrong):
    assert mismatches(expected, got) == wrong


def _gpu_rank_regions(num_blocks: int) -> list[torch.Tensor]:
    """One TP-8 rank of an 8-KV-head, 64-layer model in bf16 on 16-token blocks (Qwen3-32B on a P5en): per layer
    a K and a V region of [blocks, 16 tokens x 1 head x 128 dims x 2 bytes / 8] int64, as KvSumsCheck views them."""
    block_words = 16 * 1 * 128 * 2 // 8
    cache = torch.zeros(64 * 2, num_blocks, block_words, dtype=torch.int64)
    return list(cache.unbind(0))


@pytest.mark.parametrize("parts", [1, 2])
def test_the_number_of_tensor_ops_does_not_grow_with_scattered_blocks(parts):
    """A warm engine hands a 16k-token request 1,024 blocks in reverse order (vLLM frees them so): summed a run of
    consecutive ids at a time that was ~65k tiny ops per rank, on the writer thread and decode's step loop."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    regions = _gpu_rank_regions(1100)
    worker = KvSumsCheck(SimpleNamespace())  # a host it never reads: the regions are given
    worker._kv_regions = lambda: regions

    worker.kv_part_sums([0], parts)  # the regions' weights are made once, at the first use

    def ops(block_ids) -> int:
        Ops.count = 0
        with Ops():
            sums = worker.kv_part_sums(block_ids, parts)
        assert sums.shape == (1, len(block_ids), parts)
        return Ops.count

    gathered = ops(list(range(1023, -1, -1)))
    assert gathered == ops(list(range(15, -1, -1))) == ops(list(range(0, 1024, 2)))  # more runs than MAX_RUNS
    assert ops(list(range(1024))) == ops(list(range(16)))  # one run: summed in place
    bound = (4 * kv_digest.MAX_RUNS + 4) * len(regions) + 8  # a constant: ops a region, whatever the block count
    assert max(gathered, ops([5, 900, 3]), ops(list(range(1024)))) <= bound


def test_a_blocks_digest_is_its_regions_sums_weighed_by_odd_words_in_the_order_asked():
    worker = Worker.of("w", seed=9)
    ids = [5, 6, 7, 0, 2]
    digests = worker.checks.kv_sums(ids)
    caches = list(worker.host.device_kv_caches.values())
    weights = [int(w) % 2**64 for w in kv_digest.region_weights(worker.host.num_regions, "cpu")]
    assert all(w % 2 for w in weights) and len(set(weights)) == worker.host.num_regions
    for position, block in enumerate(ids):
        sums = [int(caches[region // 2][region % 2, block].contiguous().view(torch.int64).sum()) % 2**64
                for region in range(worker.host.num_regions)]
        expected = sum(w * s for w, s in zip(weights, sums)) % 2**64
        assert int(digests[0, position]) % 2**64 == expected  # wrapping int64 arithmetic, as on the device


def test_one_flipped_byte_in_any_region_changes_the_blocks_digest():
    checks = Worker.of("w", seed=9).checks
    before = checks.kv_sums(range(BLOCKS))
    for region in checks._kv_regions():
        for byte_word in (0, region.shape[1] - 1):
            region[3, byte_word] ^= 0x80
            assert (checks.kv_sums(range(BLOCKS)) != before).tolist() == [[b == 3 for b in range(BLOCKS)]]
            region[3, byte_word] ^= 0x80


def test_a_clean_push_is_received_and_nothing_reaches_vllm_but_its_own_notifications():
    prefill, decode = _pair()
    decode.host._pending_completion_notifs.put(b"rdv-0:1")  # a completion of vLLM's: left for vLLM
    done, failed = _push(prefill, decode)
    assert done == {"rdv-1"} and not failed
    assert list(decode.host._pending_completion_notifs.queue) == [b"rdv-0:1"]
    assert not decode.checks._sums.expected  # used once, then dropped


@pytest.mark.parametrize("fault", ["flip", "shift"])
def test_kv_that_lands_wrong_fails_the_receive_so_vllm_recomputes_it(fault, tmp_path, monkeypatch):
    (tmp_path / "fault").write_text(fault)
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(tmp_path / "fault"))
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    prefill, decode = _pair()
    done, failed = _push(prefill, decode)
    assert done == set() and failed == ["rdv-1"]


def test_a_write_that_never_happened_is_caught_too():
    prefill, decode = _pair()
    prefill.host._xfer_blocks_for_req = lambda req_id, meta: None  # the sums are sent (checks.writing), no WRITE
    assert _push(prefill, decode)[1] == ["rdv-1"]


def test_faults_need_both_switches(tmp_path, monkeypatch):
    (tmp_path / "fault").write_text("flip")
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(tmp_path / "fault"))
    assert faults.injected_fault() is None
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    assert faults.injected_fault() == "flip"
    (tmp_path / "fault").write_text("")
    assert faults.injected_fault() is None

    from app.tools.preflight import fault_injection_refusal

    assert fault_injection_refusal({faults.FAULT_FILE_ENV: "/x"}) is not None
    assert fault_injection_refusal({faults.FAULT_FILE_ENV: "/x", faults.FAULTS_ALLOWED_ENV: "1"}) is None
    assert fault_injection_refusal({}) is None


def test_layouts_the_sums_do_not_cover_send_none_and_check_nothing():
    prefill, decode = _pair()
    prefill.host.transfer_topo.get_engine_info = lambda engine_id: SimpleNamespace(
        remote_tp_size=8, remote_block_size=16, remote_physical_blocks_per_logical=1)  # more ranks than KV heads
    done, failed = _push(prefill, decode)
    assert done == {"rdv-1"} and not failed and not prefill.host.notifs_sent
    hybrid = Worker.of("hybrid", seed=3)
    hybrid.host._has_mamba = True
    assert hybrid.checks.kv_sums([0, 1]) is None
    switched_off = Worker.of("off", seed=4, checksums=False)  # handoff.kv_checksums: false
    assert switched_off.checks.kv_sums([0, 1]) is None


def test_the_sums_notification_of_a_16k_token_request_on_a_gpu_rank_is_8_kib():
    """One word a block, not one a (layer region, block): a 64-layer model's sums of 1,024 blocks were 1 MiB a rank,
    in a NIXL notification (push) and, for all 8 ranks in base64, in every request and scheduler output (pull)."""
    prefill = Worker.of("prefill", seed=1)
    regions = _gpu_rank_regions(1100)
    prefill.checks._kv_regions = lambda: regions
    ids = list(range(1023, -1, -1))
    meta = SimpleNamespace(local_physical_block_ids=(ids,),
                           remote=SimpleNamespace(engine_id="decode", request_id="rdv-9", block_ids=(ids,)))
    prefill.checks._send_kv_sums(meta)
    (_, notif), = prefill.host.notifs_sent
    assert notif.startswith(KV_SUMS_NOTIF) and len(notif) <= 1024 * 8 + 64

    from connector.pull_checksum import PulledSums

    summed = PulledSums({"r": {rank: prefill.checks.kv_part_sums(ids) for rank in range(8)}}, layout=(8, 16, 1))
    assert len(msgspec.json.encode(summed.payload("r"))) <= 8 * 1024 * 8 * 4 // 3 + 256


def test_a_receive_is_held_until_the_device_has_digested_it_then_checked(tmp_path, monkeypatch):
    """On a GPU the digests of what landed come from a side stream: the step loop never waits for the device, and
    vLLM sees the receive (or its failure) at the step where they are in, never before."""
    made = []

    class Slow(kv_digest.DigestJob):
        steps = 2  # steps the device takes

        def ready(self):
            Slow.steps -= 1
            return Slow.steps < 0

    monkeypatch.setattr(kv_digest.DigestJob, "of", classmethod(lambda cls, compute, device: made.append(1) or Slow(compute())))
    (tmp_path / "fault").write_text("flip")
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(tmp_path / "fault"))
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    prefill, decode = _pair()
    assert _push(prefill, decode) == (set(), [])  # landed, flipped, being digested: neither done nor failed
    assert _pop(decode) == (set(), [])
    assert _pop(decode) == (set(), ["rdv-1"])
    assert len(made) == 2 and not decode.checks._sums.checking  # prefill's sums, decode's: once each

    (tmp_path / "fault").write_text("")
    Slow.steps = 1
    assert _push(prefill, decode, request_id="rdv-2") == (set(), [])
    assert _pop(decode) == ({"rdv-2"}, [])


@pytest.mark.parametrize("fault", ["", "flip", "shift"])
def test_kv_staged_through_host_memory_is_checked_where_nixl_moves_it(fault, tmp_path, monkeypatch):
    """kv_buffer_device "cpu" on a device NIXL cannot register (the Trainium config): the sums are of the host
    buffers NIXL moves, on both sides (they were switched off there, with a log line as the only sign)."""
    (tmp_path / "fault").write_text(fault)
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(tmp_path / "fault"))
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    prefill, decode = _pair()
    prefill.host.stage_through_host()
    decode.host.stage_through_host()
    assert prefill.checks.kv_sums([1, 2]) is not None
    done, failed = _push(prefill, decode)
    assert (done, failed) == (({"rdv-1"}, []) if not fault else (set(), ["rdv-1"]))


@pytest.mark.parametrize("fault, mismatched", [("", set()), ("flip-history", {"chatcmpl-rdv-5-9f8e7d6c"})])
def test_a_history_read_back_is_checked_against_the_sums_decode_offered(fault, mismatched, tmp_path, monkeypatch):
    """D->P: decode's registration carries the sums of the history blocks it offers; prefill checks the
    blocks its READ landed (paired one to one with the offered ones it read), and a mismatch fails the
    READ (prefill recomputes) and is handed to the scheduler for the turn's report."""
    (tmp_path / "fault").write_text(fault)
    monkeypatch.setenv(faults.FAULT_FILE_ENV, str(tmp_path / "fault"))
    monkeypatch.setenv(faults.FAULTS_ALLOWED_ENV, "1")
    from connector.push_reuse import OFFER_KEY
    from connector.side_notifs import HISTORY_READ_ID

    decode, prefill = Worker.of("decode", seed=5), Worker.of("prefill", seed=6)
    offered = [3, 1, 4]
    decode._do_send_reg_notif("chatcmpl-rdv-5-0a1b2c3d", {"request_id": "chatcmpl-rdv-5-0a1b2c3d", "decode_tp_size": 1,
                                                   OFFER_KEY: {"block_ids": offered, "num_tokens": 48}})
    (registration,) = decode.host.registrations_sent
    prefill._handle_push_reg_notif(registration)
    assert prefill.host.registrations_seen == [registration]  # vLLM's handler still gets it
    # The READ of the first two offered blocks into prefill's blocks 6 and 7, as vLLM's pull READ copies them.
    for mine, theirs in zip(prefill.host.device_kv_caches.values(), decode.host.device_kv_caches.values()):
        mine[:, [6, 7]] = theirs[:, [3, 1]]
    rid = "chatcmpl-rdv-5-9f8e7d6c"
    prefill.host._recving_metadata[rid] = SimpleNamespace(
        local_block_ids=[[6, 7]], local_physical_block_ids=([6, 7],),
        remote=SimpleNamespace(request_id=HISTORY_READ_ID, block_ids=([3, 1],)))
    prefill.host._recving_transfers[rid] = []
    assert _pop(prefill) == ({rid} - mismatched, sorted(mismatched))
    meta = prefill.build_connector_worker_meta()
    assert (meta.mismatched if meta else set()) == mismatched
    assert not prefill.checks._sums.history_sums  # the offer's sums were found, and used once


def _receive(decode, request_id, remote, notifs):
    """Decode's side of a push: the sums notifications its agent got, then the receive's check."""
    for notif in notifs:
        decode.host._pending_completion_notifs.put(notif)
    decode.host._recving_metadata[request_id] = SimpleNamespace(local_block_ids=[list(remote)],
                                                                local_physical_block_ids=(list(remote),), remote=None)
    decode.host._recving_transfers[request_id] = []
    decode._get_new_notifs()
    return _pop(decode)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (4, 1), (1, 2), (1, 4), (2, 4), (4, 2)])
@pytest.mark.parametrize("corrupt", [None, "first", "last"])
def test_between_different_tp_sizes_each_decode_rank_checks_exactly_its_share(prefill_tp, decode_tp, corrupt):
    """vLLM moves each block between TP ranks by KV-head chunk: a prefill rank of the smaller TP WRITEs
    chunk j of its blocks to the j-th of its decode ranks, a prefill rank of the bigger TP WRITEs its
    whole blocks into its chunk of a decode rank's. The stand-in WRITE below moves exactly those bytes;
    every decode rank checks what landed in its blocks against its senders' sums, and a byte wrong in
    one decode rank's share fails that rank's receive (vLLM recomputes if any rank fails) and no other."""
    prefills = [Worker.of("prefill", seed=10 + r, tp_rank=r, world_size=prefill_tp, remote_tp=decode_tp)
                for r in range(prefill_tp)]
    decodes = [Worker.of("decode", seed=20 + r, tp_rank=r, world_size=decode_tp) for r in range(decode_tp)]
    agents = {f"decode-agent-{r}": r for r in range(decode_tp)}
    for prefill in prefills:
        prefill.host._remote_agents = {"decode": {(0, r): name for name, r in agents.items()}}
        prefill.host.targets = [(decode.host, *moved) for decode in decodes if (moved := chunks_moved(
            prefill_tp, prefill.host.tp_rank, decode_tp, decode.host.tp_rank))]
    remote = (6, 5, 0)
    meta = lambda: SimpleNamespace(local_physical_block_ids=([1, 2, 3, 4],),  # noqa: E731
                                   remote=SimpleNamespace(engine_id="decode", request_id="rdv-7", block_ids=(list(remote),)))
    for prefill in prefills:
        prefill._xfer_blocks_for_req("prefill-id", meta())
    wrong_rank = {None: None, "first": 0, "last": decode_tp - 1}[corrupt]
    if wrong_rank is not None:  # one byte of one layer of one block, after it landed on that rank
        next(iter(decodes[wrong_rank].host.device_kv_caches.values()))[1, 5, -1] += 1.0
    for rank, decode in enumerate(decodes):
        notifs = [n for p in prefills for agent, n in p.host.notifs_sent if agents[agent] == rank]
        assert len(notifs) == max(1, prefill_tp // decode_tp)  # one from every prefill rank that WRITEs here
        done, failed = _receive(decode, "rdv-7", remote, notifs)
        assert (done, failed) == ((set(), ["rdv-7"]) if rank == wrong_rank else ({"rdv-7"}, []))


def test_a_decode_rank_missing_a_producers_sums_checks_nothing_rather_than_a_part():
    """Three of four prefill ranks' sums: comparing a part with the whole would be a false alarm."""
    prefills = [Worker.of("prefill", seed=30 + r, tp_rank=r, world_size=4) for r in range(4)]
    decode = Worker.of("decode", seed=40)
    for prefill in prefills[:3]:
        prefill.checks._send_kv_sums(SimpleNamespace(local_physical_block_ids=([1, 2],), remote=SimpleNamespace(
            engine_id="decode", request_id="rdv-8", block_ids=([3, 4],))))
    assert _receive(decode, "rdv-8", (3, 4), [n for p in prefills for _, n in p.host.notifs_sent]) == ({"rdv-8"}, [])


def test_a_block_is_summed_in_chunks_that_add_up_to_its_sum():
    worker = Worker.of("w", seed=11)
    ids = [3, 4, 0]
    chunks = worker.checks.kv_part_sums(ids, 4)
    assert chunks.shape == (1, 3, 4)
    assert (chunks.sum(axis=2) == worker.checks.kv_sums(ids)).all()  # int64, wrapping: digests add up as sums do
    caches = list(worker.host.device_kv_caches.values())
    weights = [int(w) for w in kv_digest.region_weights(worker.host.num_regions, "cpu")]
    chunk_sums = [int(caches[r // 2][r % 2, 3, 16:32].contiguous().view(torch.int64).sum()) for r in range(LAYERS * 2)]
    assert int(chunks[0, 0, 1]) % 2**64 == sum(w * s for w, s in zip(weights, chunk_sums)) % 2**64
    assert worker.checks.kv_part_sums(ids, 3) is None  # 64 float32 a block: not three equal chunks of whole words


@pytest.mark.parametrize("decode_tp, prefill_tp", [(1, 2), (2, 1), (1, 4), (4, 2)])
@pytest.mark.parametrize("corrupt", [False, True])
def test_a_history_read_back_between_different_tp_sizes_is_checked_against_every_decode_ranks_offer(
        decode_tp, prefill_tp, corrupt):
    """D->P between TP sizes: every decode rank registers alone, with the sums of its share of the
    offered blocks (in as many chunks as prefill has ranks a block of its); each prefill rank READs
    the head chunks it holds from the decode ranks that hold them (copied below as vLLM's descriptors
    move them) and checks them against those ranks' sums."""
    from connector.push_reuse import OFFER_KEY
    from connector.side_notifs import HISTORY_READ_ID

    decodes = [Worker.of("decode", seed=50 + r, tp_rank=r, world_size=decode_tp) for r in range(decode_tp)]
    prefills = [Worker.of("prefill", seed=60 + r, tp_rank=r, world_size=prefill_tp) for r in range(prefill_tp)]
    for decode in decodes:
        decode._do_send_reg_notif("chatcmpl-rdv-6-0a1b2c3d", {
            "request_id": "chatcmpl-rdv-6-0a1b2c3d", "decode_tp_size": decode_tp, "remote_tp_size": prefill_tp,
            OFFER_KEY: {"block_ids": [3, 1, 4], "num_tokens": 48}})
    rid = "chatcmpl-rdv-6-9f8e7d6c"
    for rank, prefill in enumerate(prefills):
        for decode in decodes:
            prefill._handle_push_reg_notif(decode.host.registrations_sent[0])
            if moved := chunks_moved(decode_tp, decode.host.tp_rank, prefill_tp, rank):
                for mine, src in zip(prefill.host.device_kv_caches.values(), decode.host.device_kv_caches.values()):
                    mine[:, [6, 7], moved[1]] = src[:, [3, 1], moved[0]]
        if corrupt and rank == prefill_tp - 1:
            next(iter(prefill.host.device_kv_caches.values()))[1, 7, 0] += 1.0
        prefill.host._recving_metadata[rid] = SimpleNamespace(
            local_block_ids=[[6, 7]], local_physical_block_ids=([6, 7],),
            remote=SimpleNamespace(request_id=HISTORY_READ_ID, block_ids=([3, 1],)))
        prefill.host._recving_transfers[rid] = []
        done = _pop(prefill)[0]
        assert done == (set() if corrupt and rank == prefill_tp - 1 else {rid})


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_history_that_lands_before_a_decode_ranks_offer_waits_for_it_then_is_checked(corrupt, monkeypatch):
    """Each decode rank registers alone, and prefill's READ starts on the first offer: on a busy box the last
    decode rank's offer (with its sums) came after the READ landed, and the history went unchecked (TP 1 <- 3:
    a corrupted one was reused). Here TP 1 <- 2. The check waits for every rank it reads from, kv_checksum.SUMS_WAIT_S at most."""
    from connector.push_reuse import OFFER_KEY
    from connector.side_notifs import HISTORY_READ_ID

    now = [100.0]
    monkeypatch.setattr(kv_checksum.time, "monotonic", lambda: now[0])
    decodes = [Worker.of("decode", seed=70 + r, tp_rank=r, world_size=2) for r in range(2)]
    prefill = Worker.of("prefill", seed=80)
    for decode in decodes:
        decode._do_send_reg_notif("chatcmpl-rdv-7-0a1b2c3d", {
            "request_id": "chatcmpl-rdv-7-0a1b2c3d", "decode_tp_size": 2, "remote_tp_size": 1,
            OFFER_KEY: {"block_ids": [3, 1, 4], "num_tokens": 48}})
        if moved := chunks_moved(2, decode.host.tp_rank, 1, 0):
            for mine, src in zip(prefill.host.device_kv_caches.values(), decode.host.device_kv_caches.values()):
                mine[:, [6, 7], moved[1]] = src[:, [3, 1], moved[0]]
    if corrupt:
        next(iter(prefill.host.device_kv_caches.values()))[1, 7, 0] += 1.0
    rid = "chatcmpl-rdv-7-9f8e7d6c"
    for decode in decodes[:1]:  # the second rank's offer is late
        prefill._handle_push_reg_notif(decode.host.registrations_sent[0])
    prefill.host._recving_metadata[rid] = SimpleNamespace(
        local_block_ids=[[6, 7]], local_physical_block_ids=([6, 7],),
        remote=SimpleNamespace(request_id=HISTORY_READ_ID, block_ids=([3, 1],)))
    prefill.host._recving_transfers[rid] = []
    assert _pop(prefill)[0] == set()  # landed: its check waits
    now[0] += kv_checksum.SUMS_WAIT_S / 2
    assert _pop(prefill)[0] == set()
    prefill._handle_push_reg_notif(decodes[1].host.registrations_sent[0])
    assert _pop(prefill) == ((set(), [rid]) if corrupt else ({rid}, []))


def test_a_history_whose_decode_rank_never_offers_is_given_up_on_after_the_wait(monkeypatch):
    from connector.push_reuse import OFFER_KEY
    from connector.side_notifs import HISTORY_READ_ID

    now = [100.0]
    monkeypatch.setattr(kv_checksum.time, "monotonic", lambda: now[0])
    decode = Worker.of("decode", seed=90, tp_rank=0, world_size=2)
    decode._do_send_reg_notif("chatcmpl-rdv-8-0a1b2c3d", {
        "request_id": "chatcmpl-rdv-8-0a1b2c3d", "decode_tp_size": 2, "remote_tp_size": 1,
        OFFER_KEY: {"block_ids": [3, 1], "num_tokens": 32}})
    prefill = Worker.of("prefill", seed=91)
    prefill._handle_push_reg_notif(decode.host.registrations_sent[0])
    rid = "chatcmpl-rdv-8-9f8e7d6c"
    prefill.host._recving_metadata[rid] = SimpleNamespace(
        local_block_ids=[[6, 7]], local_physical_block_ids=([6, 7],),
        remote=SimpleNamespace(request_id=HISTORY_READ_ID, block_ids=([3, 1],)))
    prefill.host._recving_transfers[rid] = []
    assert _pop(prefill)[0] == set()
    now[0] += kv_checksum.SUMS_WAIT_S + 0.1
    assert _pop(prefill)[0] == {rid}  # unchecked, as before: not held forever
