"""Progressive push (connector/progressive.py): which blocks each prefill step completes, where they go on decode,
what the last WRITE still moves, and what a failed chunk WRITE does. Starts nothing; the engines' side is in
tests/integration/test_multi_replica.py."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

from connector.progressive import CHUNK_KEY, CHUNKS_ATTR, Chunk, ProgressiveWriter, _Leg, chunk_pairs, plan_chunks, rest_pairs
from connector.side_notifs import WONT_WRITE_NOTIF

BS = 128


def _out(new=(), cached=(), resumed=(), scheduled=None):
    """vLLM's SchedulerOutput, as much of it as the plan reads: new = (id, blocks, computed); cached = (id, new
    blocks or None, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(resumed),
                                              new_block_ids=[None if b is None else (list(b),) for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=dict(scheduled or {}),
    )


def test_each_step_but_the_last_hands_over_the_blocks_it_completed():
    legs = {"p1": _Leg(1100)}  # 9 blocks; chunks of 512 tokens: 4 blocks, 4 blocks, then the last 76 tokens
    assert plan_chunks(legs, _out(new=[("p1", [10, 11, 12, 13], 0)], scheduled={"p1": 512}), BS) == {
        "p1": Chunk(0, (10, 11, 12, 13), 9)}
    assert plan_chunks(legs, _out(cached=[("p1", [14, 15, 16, 17], 512)], scheduled={"p1": 512}), BS) == {
        "p1": Chunk(4, (14, 15, 16, 17), 9)}
    assert plan_chunks(legs, _out(cached=[("p1", [18], 1024)], scheduled={"p1": 76}), BS) == {}  # vLLM's WRITE


@pytest.mark.parametrize("name, steps, expected", [
    # A chunk ending inside a block hands over only the full ones; the partial block goes with the next chunk.
    ("partial block", [(_out(new=[("p1", [1, 2, 3], 0)], scheduled={"p1": 300}), {"p1": Chunk(0, (1, 2), 5)}),
                       (_out(cached=[("p1", [4], 300)], scheduled={"p1": 200}), {"p1": Chunk(2, (3,), 5)})], None),
    # Blocks prefill had cached (or read back: a conversation's history) are done from the first step.
    ("cached prefix", [(_out(new=[("p1", [7, 8, 9, 1], 256)], scheduled={"p1": 128}), {"p1": Chunk(0, (7, 8, 9), 5)})], None),
    # Preempted: a new block table; everything goes again, marked so that the worker forgets what it wrote.
    ("resumed", [(_out(new=[("p1", [1, 2], 0)], scheduled={"p1": 256}), {"p1": Chunk(0, (1, 2), 5)}),
                 (_out(cached=[("p1", [5, 6, 7], 0)], resumed=["p1"], scheduled={"p1": 384}),
                  {"p1": Chunk(0, (5, 6, 7), 5, restart=True)})], None),
    # A request that is no prefill leg of ours (not in legs), and a step that schedules nothing of the leg.
    ("others", [(_out(new=[("other", [1, 2, 3, 4], 0)], scheduled={"other": 512}), {})], None),
])
def test_plan(name, steps, expected):
    legs = {"p1": _Leg(600)}
    for out, chunks in steps:
        assert plan_chunks(legs, out, BS) == chunks, name


def test_a_leg_with_several_kv_cache_groups_is_left_to_vllm():
    legs = {"p1": _Leg(600)}
    out = _out(scheduled={"p1": 512})
    out.scheduled_new_reqs = [SimpleNamespace(req_id="p1", block_ids=([1, 2, 3, 4], [5]), num_computed_tokens=0)]
    assert plan_chunks(legs, out, BS) == {} and legs == {}


@pytest.mark.parametrize("chunk, decode, pairs", [
    (Chunk(0, (10, 11), 4), [20, 21, 22, 23], [(10, 20), (11, 21)]),
    (Chunk(2, (12, 13), 4), [20, 21, 22, 23], [(12, 22), (13, 23)]),
    # Decode holds the first 3 blocks (a conversation's history): it registered only the last one.
    (Chunk(0, (10, 11), 4), [23], []),
    (Chunk(2, (12, 13), 4), [22, 23], [(12, 22), (13, 23)]),
    (Chunk(2, (12, 13), 4), [23], [(13, 23)]),
])
def test_a_chunk_goes_to_the_decode_blocks_vllm_would_pair_it_with(chunk, decode, pairs):
    assert chunk_pairs(list(enumerate(chunk.block_ids, start=chunk.first)), chunk.total_blocks, decode) == pairs


def test_the_last_write_moves_what_the_chunks_did_not_and_never_nothing():
    assert rest_pairs([1, 2, 3], [7, 8, 9], {(1, 7), (2, 8)}) == [(3, 9)]
    assert rest_pairs([0, 1, 2, 3], [7, 8, 9], {(1, 7)}) == [(2, 8), (3, 9)]  # end-trimmed as vLLM trims
    assert rest_pairs([1, 2], [7, 8], {(1, 7), (2, 8)}) == [(2, 8)]  # it carries the completion
    assert rest_pairs([1, 2], [7, 8], {(1, 8)}) == [(1, 7), (2, 8)]  # written elsewhere (preempted): again


# ------------------------------------------------------------------------------------------- the writer
REGISTRATION = {"request_id": "cmpl-rdv-1-0", "decode_engine_id": "decode-engine", "decode_host": "127.0.0.1",
                "decode_port": 5601, "decode_tp_size": 1, "local_block_ids": [[20, 21, 22, 23]]}


class _Nixl:
    def __init__(self, states):
        self.states, self.sent = states, []

    def send_notif(self, agent_name, notif_msg):
        self.sent.append((agent_name, notif_msg))


class _Host:
    """What ProgressiveWriter reads of vLLM's push worker on prefill."""

    def __init__(self, states):
        self._pending_d_registrations = {"cmpl-rdv-1-0": dict(REGISTRATION)}
        self._sending_transfers, self._sending_transfers_lock, self._send_failures = {}, threading.Lock(), set()
        self._deferred_push_inbox, self._push_writer_wake, self._push_writer_stop = queue.Queue(), threading.Event(), threading.Event()
        self._remote_agents = {"decode-engine": {(0, 0): "decode-agent-0"}}
        self.nixl_wrapper = _Nixl(states)
        self._physical_blocks_per_logical_kv_block, self.use_host_buffer, self.world_size = 1, False, 1
        self.transfer_topo = SimpleNamespace(get_engine_info=lambda e: SimpleNamespace(remote_physical_blocks_per_logical=1))
        self._pending_completion_notifs = queue.Queue()
        self.posted: list[tuple[str, ReqMeta]] = []

    def _ensure_handshake(self, *args):
        return None  # done

    @staticmethod
    def _as_grouped_block_ids(ids):
        return ids if ids and isinstance(ids[0], list) else (list(ids),)

    @staticmethod
    def _logical_to_kernel_block_ids(ids, ratio):
        return ids

    def xfer(self, key, meta):  # vLLM's _xfer_blocks_for_req: one handle per WRITE, filed under its key
        self.posted.append((key, meta))
        with self._sending_transfers_lock:
            self._sending_transfers.setdefault(key, []).append(len(self.posted))

    def pop_done(self, transfers):  # vLLM's _pop_done_transfers, reading the states the test sets
        # A failed handle is released, as vLLM's _handle_failed_transfer does: its key is done, and failed.
        done = {k for k, handles in transfers.items() if all(self.nixl_wrapper.states.get(h) in ("DONE", "ERR") for h in handles)}
        failed = {k for k, handles in transfers.items() if any(self.nixl_wrapper.states.get(h) == "ERR" for h in handles)}
        for k in done:
            del transfers[k]
        return done, failed


def _writer(states=None):
    host = _Host(states if states is not None else {})
    return host, ProgressiveWriter(host, True, xfer=host.xfer, pop_done=host.pop_done)


def _run_tasks(host):
    while not host._deferred_push_inbox.empty():
        _, task, _ = host._deferred_push_inbox.get()
        task.run()


def _full_write_meta():
    return ReqMeta(local_block_ids=([10, 11, 12, 13],), local_physical_block_ids=([10, 11, 12, 13],), tp_size=1,
                   remote=RemoteMeta(block_ids=([20, 21, 22, 23],), host="", port=0, engine_id="decode-engine",
                                     request_id="cmpl-rdv-1-0"))


def test_chunks_are_written_as_they_are_done_and_the_last_write_moves_only_the_rest():
    host, writer = _writer({1: "DONE", 2: "DONE"})
    for chunk in (Chunk(0, (10,), 4), Chunk(1, (11, 12), 4)):
        writer.saved(SimpleNamespace(**{CHUNKS_ATTR: {"cmpl-rdv-1-0": chunk}}))
        _run_tasks(host)
    assert [(k.startswith(CHUNK_KEY), m.local_block_ids, m.remote.block_ids) for k, m in host.posted] == [
        (True, ([10],), ([20],)), (True, ([11, 12],), ([21, 22],))]
    # Decode takes them aside, not as the completion, and stamps each for the request's timeline by its index.
    assert [m.remote.request_id for _, m in host.posted] == [CHUNK_KEY + "cmpl-rdv-1-0#0", CHUNK_KEY + "cmpl-rdv-1-0#1"]
    assert host._sending_transfers == {}  # the writer took its chunk handles: vLLM never reaps them as the leg's
    assert writer.before_last_write("cmpl-rdv-1-0", REGISTRATION)
    last = writer.last_write("cmpl-rdv-1-0", _full_write_meta())
    assert (last.local_block_ids, last.remote.block_ids, last.remote.request_id) == (([13],), ([23],), "cmpl-rdv-1-0")


def test_chunks_computed_before_the_registration_go_in_one_write_when_it_comes():
    host, writer = _writer()
    registration = host._pending_d_registrations.pop("cmpl-rdv-1-0")
    for chunk in (Chunk(0, (10,), 4), Chunk(1, (11,), 4)):
        writer.saved(SimpleNamespace(**{CHUNKS_ATTR: {"cmpl-rdv-1-0": chunk}}))
        _run_tasks(host)
    assert host.posted == []
    from connector.progressive import PUSH_REG_NOTIF_PREFIX, msgspec
    assert writer.registering(PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(registration)) is False  # vLLM takes it
    assert [(m.local_block_ids, m.remote.block_ids) for _, m in host.posted] == [(([10, 11],), ([20, 21],))]


def test_the_last_write_waits_for_the_chunks_and_a_failed_one_makes_decode_recompute_at_once():
    states = {1: "PROC"}
    host, writer = _writer(states)
    writer.saved(SimpleNamespace(**{CHUNKS_ATTR: {"cmpl-rdv-1-0": Chunk(0, (10, 11), 4)}}))
    _run_tasks(host)
    assert not writer.may_release("cmpl-rdv-1-0")  # a chunk may still land: decode must keep its blocks
    threading.Timer(0.05, lambda: states.update({1: "ERR"})).start()
    assert writer.before_last_write("cmpl-rdv-1-0", REGISTRATION) is False  # waited, then saw it fail
    assert host.nixl_wrapper.sent == [("decode-agent-0", WONT_WRITE_NOTIF + b"cmpl-rdv-1-0")]


def test_without_chunks_vllms_last_write_is_untouched():
    host, writer = _writer()
    meta = _full_write_meta()
    assert writer.before_last_write("cmpl-rdv-9-0", REGISTRATION) and writer.last_write("cmpl-rdv-9-0", meta) is meta
