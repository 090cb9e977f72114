"""A push registration withdrawn by decode (connector/push_deadline.py): decode aborted a request still
waiting for its KV; prefill, which may never have seen that leg, treats it as aborted and says at once
that it will not WRITE, so decode's blocks go back in a step instead of at their work-sized expiry."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector.push_connector import PushScheduler
from connector.push_deadline import DROP_KEY, DeadlineWorker
from connector.side_notifs import WONT_WRITE_NOTIF
from tests.support.connectors import push_scheduler

REGISTRATION = {
    "request_id": "cmpl-rdv-1-0", "decode_engine_id": "decode-engine", "decode_host": "127.0.0.1", "decode_port": 5601,
    "decode_tp_size": 1, "local_block_ids": [[3, 4]], "remote_engine_id": "prefill-engine", "remote_host": "127.0.0.1",
    "remote_port": 5600, "remote_tp_size": 1, "remote_pp_size": 1, "rendezvous_offer": {"block_ids": [1]},
}


def _scheduler() -> PushScheduler:
    scheduler = push_scheduler()
    # Registrations staged and stamped for both (as update_state_after_alloc leaves them, once vLLM sent them).
    scheduler._deadline._registered = {"cmpl-rdv-1-0": dict(REGISTRATION),
                                       "cmpl-rdv-2-0": dict(REGISTRATION, request_id="cmpl-rdv-2-0")}
    return scheduler


def test_decode_withdraws_the_registration_of_a_request_that_ends_before_its_kv_landed():
    scheduler = _scheduler()
    waiting = SimpleNamespace(request_id="cmpl-rdv-1-0", kv_transfer_params=None, num_computed_tokens=0,
                              status="FINISHED_ABORTED")
    landed = SimpleNamespace(request_id="cmpl-rdv-2-0", kv_transfer_params=None, num_computed_tokens=12,
                             status="FINISHED_ABORTED")
    assert scheduler.request_finished(waiting, [[3, 4]]) == (False, None)
    scheduler.request_finished(landed, [[5]])
    withdrawal = scheduler._push_pending_registrations.pop("cmpl-rdv-1-0")
    assert withdrawal[DROP_KEY] is True and "local_block_ids" not in withdrawal and "rendezvous_offer" not in withdrawal
    assert withdrawal["remote_engine_id"] == "prefill-engine" and withdrawal["decode_engine_id"] == "decode-engine"
    # A landed one: nothing to say.
    assert scheduler._push_pending_registrations == {} and scheduler._deadline._registered == {}


class _Nixl:
    def __init__(self):
        self.sent = []

    def send_notif(self, agent_name, notif_msg):
        self.sent.append((agent_name, notif_msg))


class _VllmPrefillWorker:
    """What DeadlineWorker relies on of vLLM's push worker on prefill, with vLLM's own handling of a
    registration notification (kept in _pending_d_registrations until the leg's blocks are ready)."""

    _handle_push_reg_notif = NixlPushConnectorWorker._handle_push_reg_notif

    def __init__(self):
        self._pending_d_registrations = {}
        self._remote_agents = {"decode-engine": {0: "decode-agent-0"}}
        self.nixl_wrapper = _Nixl()

    def _pop_matching_finished_blocks(self, request_id):
        return None  # its leg has computed nothing here


class _Worker(_VllmPrefillWorker):
    """The host above with the deadline composed in as connector.push_connector.PushWorker composes it."""

    def __init__(self):
        super().__init__()
        self._deadline = DeadlineWorker(self)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        if not self._deadline.withdrawn(notif):
            super()._handle_push_reg_notif(notif)
            self._deadline.registered()


def _worker() -> _Worker:
    return _Worker()


def _notif(registration: dict) -> bytes:
    return PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(registration)


def test_prefill_answers_a_withdrawal_with_wont_write_whether_the_registration_came_before_or_after_it():
    withdrawal = {"request_id": "cmpl-rdv-1-0", "decode_engine_id": "decode-engine", "remote_engine_id": "prefill-engine",
                  DROP_KEY: True}
    before = _worker()
    before._handle_push_reg_notif(_notif(REGISTRATION))
    assert list(before._pending_d_registrations) == ["cmpl-rdv-1-0"] and before.nixl_wrapper.sent == []
    before._handle_push_reg_notif(_notif(withdrawal))
    assert before._pending_d_registrations == {}
    assert before.nixl_wrapper.sent == [("decode-agent-0", WONT_WRITE_NOTIF + b"cmpl-rdv-1-0")]

    after = _worker()  # the withdrawal overtook the registration: kept, and answered when it comes
    after._handle_push_reg_notif(_notif(withdrawal))
    assert after.nixl_wrapper.sent == [] and after._pending_d_registrations == {}
    after._handle_push_reg_notif(_notif(REGISTRATION))
    assert after._pending_d_registrations == {}
    assert after.nixl_wrapper.sent == [("decode-agent-0", WONT_WRITE_NOTIF + b"cmpl-rdv-1-0")]


def test_a_registration_the_writer_thread_took_is_never_answered_wont_write():
    """The WRITE may be under way: only its completion frees decode's blocks."""
    worker = _worker()
    worker._handle_push_reg_notif(_notif({"request_id": "cmpl-rdv-1-0", "decode_engine_id": "decode-engine",
                                          DROP_KEY: True}))
    assert worker.nixl_wrapper.sent == [] and worker._pending_d_registrations == {}
