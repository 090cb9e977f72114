"""vLLM's push scheduler and worker with our features composed in (vLLM-side; imports neither Ray nor ``app``).

Each vLLM hook we need is overridden here, once, and calls the features in the order written in
it; the features are objects (``connector.feature``), each built once from the typed settings
(``connector.settings``). ``connector.vllm_connectors`` turns vLLM's own scheduler and worker into
these classes (``_extend``). What each feature does is in its module:

- ``push_deadline``: a deadline on pushed KV, and withdrawals of registrations nobody will WRITE;
- ``push_reuse``: a conversation's history that decode holds, offered to prefill and READ back;
- ``idle_wait``: engines that sleep instead of stepping while they only wait for KV;
- ``kv_identity``: prefill WRITEs only into a registration for the same prompt tokens;
- ``kv_checksum``: digests of pushed KV, checked on landing (and of a history read back);
- ``stages``: when each leg reached each stage (the request timeline);
- ``transfer_order``: transfers that start before the forward pass where it blocks;
- ``progressive``: prefill WRITEs each finished chunk of a prompt while the next one computes.
"""

from __future__ import annotations

import time
from functools import partial

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

from connector.idle_wait import IdleScheduler, IdleWorker
from connector.kv_checksum import KvChecksums
from connector.kv_identity import PushIdentityScheduler, PushIdentityWorker
from connector.progressive import ProgressiveScheduler, ProgressiveWriter, WriterTask
from connector.push_deadline import DeadlineScheduler, DeadlineWorker
from connector.push_reuse import ReuseScheduler, ReuseWorker
from connector.settings import ConnectorSettings
from connector.stages import StageClock, WriteClock
from connector.transfer_order import TransfersFirst


class PushScheduler(NixlPushConnectorScheduler):
    """vLLM's push scheduler (decode and prefill) with our features."""

    def init_features(self, settings: ConnectorSettings, vllm_config) -> None:
        self._stages = StageClock(settings.kv_timeout_s)
        self._deadline = DeadlineScheduler(self, settings.kv_timeout_s)
        self._reuse = ReuseScheduler(self)
        self._idle = IdleScheduler(self, vllm_config)
        self._transfers = TransfersFirst()
        self._progressive = ProgressiveScheduler(self, settings.progressive)
        self._identity = PushIdentityScheduler(self)

    def on_new_request(self, request):
        super().on_new_request(request)
        self._idle.new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._reuse.wants(request):
            return self._reuse.matched_tokens(request, num_computed_tokens)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        stage = self._stages.before_alloc(request)
        timeout_s = self._deadline.timeout_of(request)  # both before vLLM rewrites the params
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._deadline.stamp(request, timeout_s)
        self._reuse.allocated(request, blocks, num_external_tokens)
        self._stages.allocated(request, blocks, num_external_tokens, stage)
        self._progressive.allocated(request)
        self._identity.allocated(request)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        self._stages.built(scheduler_output)
        self._idle.built(meta, scheduler_output)  # may sleep: only where the step computes and ships nothing
        self._transfers.built(meta, scheduler_output)
        self._progressive.built(meta, scheduler_output)
        self._identity.built(meta)
        return meta

    def update_connector_output(self, connector_output):
        super().update_connector_output(connector_output)
        self._reuse.output(connector_output)
        self._stages.output(connector_output)

    def request_finished(self, request, block_ids):
        stages = self._stages.finishing(request)
        registration = self._deadline.finishing(request)
        self._identity.finishing(request)
        delay, params = super().request_finished(request, block_ids)
        self._deadline.withdraw_if_unlanded(request, registration)
        self._reuse.finished(request, params)
        self._stages.finished(stages, params)
        self._idle.finished(request)
        self._progressive.finished(request)
        return delay, params


class PushWorker(NixlPushConnectorWorker):
    """vLLM's push worker (decode and prefill) with our features."""

    # vLLM's pull READ, as is, for prefill's history read back from decode (connector.push_reuse): same
    # descriptors, same failure handling (blocks that fail to load are marked invalid and recomputed).
    _read_blocks_for_req = NixlPullConnectorWorker._read_blocks_for_req
    _read_blocks = NixlPullConnectorWorker._read_blocks
    _read_blocks_mixed = NixlPullConnectorWorker._read_blocks_mixed  # KV split between DRAM and device
    _is_turn2_read_expired = NixlPullConnectorWorker._is_turn2_read_expired

    def init_features(self, settings: ConnectorSettings, vllm_config) -> None:
        self._checks = KvChecksums(self, settings.kv_checksums)
        self._clock = WriteClock(self)
        # vLLM's own WRITE and poll, not our overrides: a chunk WRITE has no sums of its own and is not vLLM's to reap.
        self._progressive = ProgressiveWriter(self, settings.progressive,
                                              xfer=partial(NixlPushConnectorWorker._xfer_blocks_for_req, self),
                                              pop_done=partial(NixlPushConnectorWorker._pop_done_transfers, self))
        self._deadline = DeadlineWorker(self, may_release=self._progressive.may_release)
        self._reuse = ReuseWorker(self)
        self._identity = PushIdentityWorker(self)
        self._idle = IdleWorker(self)  # replaces vLLM's queues with waking ones; the others read them through us

    # ---------------------------------------------------------------- the engine's main thread, each step
    def start_load_kv(self, metadata):
        self._idle.loading(metadata)
        self._identity.loading(metadata)  # before vLLM hands the finished blocks to the writer thread
        reads = self._reuse.take_history_reads(metadata)
        self._progressive.loading(metadata)
        self._deadline.loading(metadata)
        super().start_load_kv(metadata)
        self._reuse.start_history_reads(reads)

    def saved(self, metadata) -> None:
        """After the step's forward (the connector's wait_for_save): the chunks it completed go to the writer."""
        self._progressive.saved(metadata)

    def get_transfer_results(self):
        self._deadline.fail_expired_receives(time.time())  # queued as failed: reported by the call below
        self._progressive.poll()
        results = super().get_transfer_results()
        self._identity.release(results)
        return results

    def _get_new_notifs(self):
        # Ours, taken out before vLLM parses the rest as "<request id>:<tp size>" (connector.side_notifs).
        self._checks.take_notifs()
        self._clock.take_notifs()
        self._reuse.take_notifs()
        self._deadline.take_notifs()
        self._progressive.take_notifs()
        return super()._get_new_notifs()

    def _pop_done_transfers(self, transfers):
        hidden = self._progressive.hiding_chunks(transfers)
        try:
            done, failed = super()._pop_done_transfers(transfers)
        finally:
            self._progressive.restore(transfers, hidden)
        return self._checks.landed(transfers, done, failed)

    def build_connector_worker_meta(self):
        return self._checks.worker_meta(self._reuse.worker_meta())

    # ---------------------------------------------------------------- the writer thread
    def _do_send_reg_notif(self, req_id, reg_data):
        self._checks.registering(req_id, reg_data)
        return super()._do_send_reg_notif(req_id, reg_data)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        if self._progressive.registering(notif):
            return  # held back by a test-only fault; handed back here later
        self._checks.on_registration(notif)
        self._reuse.on_registration(notif)
        if not self._deadline.withdrawn(notif):
            super()._handle_push_reg_notif(notif)
            self._deadline.registered()
        self._idle.registered()

    def _do_start_push_kv(self, request_id, local_block_ids, registration_data):
        if isinstance(local_block_ids, WriterTask):  # ours, queued where vLLM's writer thread runs it
            return local_block_ids.run()
        self._identity.matched(request_id, registration_data)
        if (self._deadline.may_write(request_id, registration_data)
                and self._progressive.before_last_write(request_id, registration_data)):
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _xfer_blocks_for_req(self, req_id, meta):
        if not self._identity.may_write(req_id, meta):
            return None
        if not self._checks.writing(req_id, meta):  # the sums of every block, chunks' included
            return None
        self._clock.writing(req_id, meta)
        return super()._xfer_blocks_for_req(req_id, self._progressive.last_write(req_id, meta))
