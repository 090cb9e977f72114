"""Pull + bi-directional KV (vLLM's ``bidirectional_kv_xfer``), kept to the turns that ask
(vLLM-side; imports neither Ray nor ``app``).

With bi-directional transfer on, vLLM's pull scheduler keeps the blocks of *every*
finished decode request for ``decoder_kv_blocks_ttl`` seconds, outside the prefix cache's
eviction, so that the next turn's prefill can READ them back. One-off requests and
streamed turns (whose response cannot carry the blocks' address) would hold blocks nobody
reads until the TTL, and a busy decode engine would run out of KV. Here decode keeps only
the requests whose ``kv_transfer_params`` carry ``KEEP_HISTORY_KEY`` (the orchestrator's
non-streamed conversation turns); the others finish as without bi-directional transfer.

Swapped into vLLM's pull scheduler by ``connector.vllm_connectors``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

from connector.params import KEEP_HISTORY_KEY, is_prefill_leg


class HistoryPullScheduler(NixlPullConnectorScheduler):
    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        keep = not params or is_prefill_leg(params) or params.get(KEEP_HISTORY_KEY)
        if keep or not self.is_bidirectional_kv_xfer_enabled:
            return super().request_finished(request, block_ids)
        # Upstream decides "keep for a read-back" on this flag alone (its D-node branch).
        self.is_bidirectional_kv_xfer_enabled = False
        try:
            return super().request_finished(request, block_ids)
        finally:
            self.is_bidirectional_kv_xfer_enabled = True
