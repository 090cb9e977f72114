"""vLLM's pull scheduler and worker with our features composed in (vLLM-side; imports neither Ray nor ``app``).

As ``connector.push_connector``: each vLLM hook we need is overridden here once and calls the
features in the order written in it. The features:

- ``pull_checksum``: digests of pulled KV, carried with the request and checked on landing;
- ``pull_deadline``: a deadline on each READ;
- ``pull_history``: vLLM's own history read-back, kept to the turns that ask;
- ``kv_identity``: decode READs only a KV computed from its own prompt's tokens;
- ``idle_wait``: an engine that only holds finished requests' blocks for a peer's READ sleeps between steps;
- ``stages`` and ``transfer_order``, as in push.
"""

from __future__ import annotations

import time

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from connector.idle_wait import PullIdleScheduler, PullIdleWorker
from connector.kv_identity import PullIdentity
from connector.nixl_progress import reads_cancel
from connector.pull_checksum import PullSumsScheduler, PullSumsWorker
from connector.pull_deadline import ReadDeadline
from connector.pull_history import HistoryPullScheduler
from connector.settings import ConnectorSettings, backends
from connector.stages import StageClock
from connector.transfer_order import TransfersFirst


class PullScheduler(NixlPullConnectorScheduler):
    """vLLM's pull scheduler (decode and prefill) with our features."""

    def init_features(self, settings: ConnectorSettings, vllm_config) -> None:
        self._sums = PullSumsScheduler(self, settings.kv_checksums)
        self._stages = StageClock(settings.kv_timeout_s)
        self._history = HistoryPullScheduler(self)
        self._transfers = TransfersFirst()
        self._identity = PullIdentity()
        self._idle = PullIdleScheduler(self, vllm_config)

    def on_new_request(self, request):
        super().on_new_request(request)
        self._idle.new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._history.read_tried(request) or self._identity.matched_tokens_refused(request):
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._sums.allocating(request)
        stage = self._stages.before_alloc(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._stages.allocated(request, blocks, num_external_tokens, stage)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        self._stages.built(scheduler_output)
        self._transfers.built(meta, scheduler_output)
        self._sums.built(meta, scheduler_output)
        self._idle.built(meta, scheduler_output)  # may sleep: only where the step computes and ships nothing
        return meta

    def update_connector_output(self, connector_output):
        super().update_connector_output(connector_output)
        self._stages.output(connector_output)
        self._sums.output(connector_output)

    def request_finished(self, request, block_ids):
        prefill_leg = self._sums.finishing(request)
        stages = self._stages.finishing(request)
        with self._history.finishing(request):
            delay, params = super().request_finished(request, block_ids)
        self._stages.finished(stages, params)
        self._sums.finished(request, prefill_leg, delay, params)
        self._identity.finished(request, prefill_leg, params)
        self._idle.finished(request)
        return delay, params


class PullWorker(NixlPullConnectorWorker):
    """vLLM's pull worker (decode and prefill) with our features."""

    def init_features(self, settings: ConnectorSettings, vllm_config) -> None:
        self._checks = PullSumsWorker(self, settings.kv_checksums, settings.kv_peer_tp_size)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._deadline = ReadDeadline(self, settings.kv_timeout_s, reads_cancel(backends(extra)))
        self._idle = PullIdleWorker(self)

    def start_load_kv(self, metadata):
        self._idle.loading(metadata)
        self._checks.loading(metadata)
        super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id, meta):
        self._checks.reading(req_id, meta)
        if not self._deadline.may_read(req_id):
            return None
        return super()._read_blocks_for_req(req_id, meta)

    def _read_blocks(self, read_spec, dst_engine_id, request_id, remote_request_id, local_xfer_side_handle,
                     local_dram_handle, remote_xfer_side_handle, expected_consumers, awaiting_kvs):
        if not self._deadline.may_read_rank(read_spec, dst_engine_id, request_id):
            return True  # as if posted: the other ranks' READs go on (a test fault; its deadline ends it)
        return super()._read_blocks(read_spec, dst_engine_id, request_id, remote_request_id, local_xfer_side_handle,
                                    local_dram_handle, remote_xfer_side_handle, expected_consumers, awaiting_kvs)

    def _pop_done_transfers(self, transfers):
        done, failed = super()._pop_done_transfers(transfers)
        return self._checks.landed(transfers, self._deadline.landed(transfers, done), failed)

    def get_transfer_results(self):
        self._deadline.cancel_late_reads(time.monotonic())  # queued as failed: reported by the call below
        results = super().get_transfer_results()
        self._deadline.reported(results)
        return results

    def build_connector_worker_meta(self):
        return self._checks.worker_meta()
