"""KV identity (connector/kv_identity.py): a KV computed from other tokens than decode's prompt is never used.
Pull: decode compares prefill's digest before its READ. Push: prefill's writer compares decode's registration
before its WRITE, and tells decode at once."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from connector import stages
from connector.kv_identity import IDENTITIES_ATTR, MISMATCH, PullIdentity, PushIdentityWorker, identity_of
from connector.params import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, KV_IDENTITY_KEY
from connector.push_deadline import DeadlineWorker
from connector.side_notifs import WONT_WRITE_NOTIF, SideRoutingQueue
from tests.support.connectors import push_scheduler

PROMPT = list(range(1000, 1300))


@pytest.mark.parametrize("other", [
    PROMPT[:-1], PROMPT + [7], [PROMPT[1], PROMPT[0], *PROMPT[2:]], [*PROMPT[:150], 5, *PROMPT[151:]], [],
], ids=["shorter", "longer", "two swapped", "one changed mid-prompt", "empty"])
def test_the_digest_tells_any_other_token_sequence_apart(other):
    assert identity_of(PROMPT) == identity_of(list(PROMPT)) != identity_of(other)


@pytest.fixture
def stamps(monkeypatch):
    sent = []
    monkeypatch.setattr(stages, "send_stamps", sent.append)
    monkeypatch.setattr("connector.kv_identity.send_stamps", sent.append)
    return sent


def decode_leg(request_id: str, prompt: list[int], said: str | None):
    params = {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, "remote_block_ids": [[1, 2]]}
    if said is not None:
        params[KV_IDENTITY_KEY] = said
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, kv_transfer_params=params)


def test_pull_prefill_names_its_prompt_and_decode_reads_only_its_own(stamps):
    identity = PullIdentity()
    prefill = SimpleNamespace(request_id="cmpl-rdv-1-0", prompt_token_ids=PROMPT)
    response = {DO_REMOTE_PREFILL: True, "remote_block_ids": [[4, 5]]}  # what vLLM returns for a prefill leg
    identity.finished(prefill, True, response)
    assert response[KV_IDENTITY_KEY] == identity_of(PROMPT)

    assert not identity.matched_tokens_refused(decode_leg("cmpl-rdv-1-0", PROMPT, response[KV_IDENTITY_KEY]))
    assert stamps == []
    other = decode_leg("cmpl-rdv-2-0", PROMPT[1:] + PROMPT[:1], response[KV_IDENTITY_KEY])
    assert identity.matched_tokens_refused(other)
    assert [(s.request_id, s.failed) for s in stamps] == [("cmpl-rdv-2-0", "kv_mismatch")]
    assert identity.matched_tokens_refused(other) and len(stamps) == 1  # vLLM may ask again: refused once
    identity.finished(other, False, None)
    assert not identity.matched_tokens_refused(decode_leg("cmpl-rdv-3-0", PROMPT, None))  # an older prefill: unchecked


def test_a_decode_legs_registration_names_its_prompt_and_prefill_tells_its_workers_its_own():
    scheduler = push_scheduler()
    scheduler._push_pending_registrations["cmpl-rdv-1-0"] = {"request_id": "cmpl-rdv-1-0"}
    scheduler._identity.allocated(SimpleNamespace(request_id="cmpl-rdv-1-0", prompt_token_ids=PROMPT))
    assert scheduler._push_pending_registrations["cmpl-rdv-1-0"][KV_IDENTITY_KEY] == identity_of(PROMPT)

    scheduler._identity.finishing(SimpleNamespace(request_id="cmpl-rdv-9-0", prompt_token_ids=PROMPT[:10],
                                                  kv_transfer_params={DO_REMOTE_DECODE: True}))
    scheduler._identity.finishing(SimpleNamespace(request_id="cmpl-rdv-8-0", prompt_token_ids=PROMPT,
                                                  kv_transfer_params={DO_REMOTE_PREFILL: True}))  # a decode leg
    meta = SimpleNamespace()
    scheduler._identity.built(meta)
    assert getattr(meta, IDENTITIES_ATTR) == {"cmpl-rdv-9-0": identity_of(PROMPT[:10])}
    scheduler._identity.built(meta := SimpleNamespace())
    assert not hasattr(meta, IDENTITIES_ATTR)  # each digest goes once


class _Nixl:
    def __init__(self):
        self.sent = []

    def send_notif(self, agent_name, notif_msg):
        self.sent.append((agent_name, notif_msg))


def _prefill_worker() -> PushIdentityWorker:
    host = SimpleNamespace(_reqs_to_send={"cmpl-rdv-1-0": 9.0, "cmpl-rdv-2-0": 9.0}, _reqs_to_process=set(),
                           _remote_agents={"decode-engine": {0: "agent-0", 1: "agent-1"}}, nixl_wrapper=_Nixl())
    worker = PushIdentityWorker(host)
    worker.loading(SimpleNamespace(**{IDENTITIES_ATTR: {"cmpl-rdv-1-0": identity_of(PROMPT),
                                                        "cmpl-rdv-2-0": identity_of(PROMPT)}}))
    return worker


def _write(worker: PushIdentityWorker, request_id: str, said: str) -> bool:
    worker.matched(request_id, {"request_id": "decode-" + request_id, KV_IDENTITY_KEY: said})
    meta = SimpleNamespace(remote=SimpleNamespace(engine_id="decode-engine", request_id="decode-" + request_id))
    return worker.may_write(request_id, meta)


def test_prefill_writes_a_registration_for_its_own_prompt_and_refuses_another_telling_every_decode_rank():
    worker = _prefill_worker()
    assert _write(worker, "cmpl-rdv-1-0", identity_of(PROMPT))
    assert worker.host.nixl_wrapper.sent == []
    assert not _write(worker, "cmpl-rdv-2-0", identity_of(PROMPT[:-1]))
    notice = WONT_WRITE_NOTIF + b"decode-cmpl-rdv-2-0" + MISMATCH
    assert worker.host.nixl_wrapper.sent == [("agent-0", notice), ("agent-1", notice)]
    results = SimpleNamespace(finished_sending=set())
    worker.release(results)
    assert results.finished_sending == {"cmpl-rdv-2-0"}  # its blocks go back now, not at the lease's end
    assert "cmpl-rdv-2-0" not in worker.host._reqs_to_send


class _DecodeWorker:
    def __init__(self):
        self._pending_completion_notifs = SideRoutingQueue()
        self._recving_metadata = {"decode-cmpl-rdv-2-0": object()}
        self._recving_transfers = {}
        self.consumer_notification_counts_by_req = {}
        self._failed_recv_reqs = queue.Queue()
        self._deadline = DeadlineWorker(self)


def test_decode_fails_the_receive_at_once_and_counts_it_as_a_mismatch(stamps):
    worker = _DecodeWorker()
    worker._pending_completion_notifs.put(WONT_WRITE_NOTIF + b"decode-cmpl-rdv-2-0" + MISMATCH)
    worker._deadline.take_notifs()
    worker._deadline.fail_expired_receives(now=0.0)
    assert worker._failed_recv_reqs.get_nowait() == "decode-cmpl-rdv-2-0"  # vLLM recomputes it
    assert [(s.request_id, s.failed) for s in stamps] == [("decode-cmpl-rdv-2-0", "kv_mismatch")]
